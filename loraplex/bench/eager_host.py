"""Host work of an eager (prefill or mixed) step: `ModelRunner._run_eager` with the model stubbed.

    python -m loraplex.bench.eager_host [--requests 8] [--prompt 512] [--adapters 8] [--repeats 30]

An engine over the tiny random model (CPU) gets `requests` prompts of `prompt` tokens, each on
one of `adapters` random adapters (round-robin; 0: none), and its first step is planned (one
prefill chunk per request, up to the scheduler's token budget). The model's forward and LM head
are replaced by stubs returning zeros, so the median time of `_run_eager` on that plan is what
the runner does around the model: the per-token lists (ids, positions, KV slots), the attention
and LoRA metadata, and their host-to-device copies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import cast

import torch
from torch import nn

from loraplex.bench.random_weights import random_adapter, random_model, tiny_hf_dict
from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import Engine
from loraplex.model.llama import LlamaFamilyModel
from loraplex.types import SamplingParams


class _StubModel(nn.Module):
    """Stands in for the model: the right shapes, no work."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, ids: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.config.hidden_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.config.vocab_size)


def measure(requests: int = 8, prompt: int = 512, adapters: int = 8, repeats: int = 30) -> dict[str, float]:
    mc = ModelConfig.from_hf_dict(tiny_hf_dict())
    cpu = torch.device("cpu")
    tokens = requests * prompt
    config = EngineConfig(
        model_dir="<random weights>",
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            block_size=16, num_blocks=requests * (-(-prompt // 16) + 1), max_model_len=prompt + 16
        ),
        lora=LoRAConfig(max_rank=16),
        scheduler=SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=tokens),
    )
    engine = Engine(config, model=random_model(mc, torch.float32, cpu, 0))
    names = [f"a{i}" for i in range(adapters)]
    for i, name in enumerate(names):
        engine.register_imported(name, random_adapter(mc, 8, 1000 + i, torch.float32, cpu))
    engine.runner.model = cast(LlamaFamilyModel, _StubModel(mc))  # the model's interface, no work
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        prompt_ids = [3 + (i + j) % 50 for j in range(prompt)]
        engine.add_request(f"r{i}", prompt_ids, params, names[i % adapters] if adapters else None)
    plan = engine.scheduler.schedule()
    slots = engine.slot_map(plan)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.runner._run_eager(plan, slots, None)
        times.append(time.perf_counter() - t0)
    return {
        "rows": float(sum(c.num_tokens for c in plan.chunks)),
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = measure(args.requests, args.prompt, args.adapters, args.repeats)
    print(
        f"{int(r['rows'])} rows ({args.requests} x {args.prompt} tokens, {args.adapters} adapters): "
        f"eager-step host work median {r['median_ms']:.3f} ms, min {r['min_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()
