"""Golden outputs for refactors that must not change results: record a mixed batch's tokens and
logprobs with one version of the code, check them with another.

    python benchmarks/golden_outputs.py record --device cpu --out docs/results/golden-cpu.json
    python benchmarks/golden_outputs.py check  --device cpu --golden docs/results/golden-cpu.json

The batch: a tiny random Llama (built from a fixed seed; nothing downloaded) with PEFT adapters of
ranks 8, 16, 32 and 64 on different target sets, two revisions of one name, base-only rows,
prompts of 1 to 130 tokens, greedy decoding with logprobs and prompt logprobs, and seeded
sampling; then the demo model with its four task adapters. On the CPU (float32) the check wants
every token and every logprob bit-identical; on CUDA (bfloat16) every token identical, logprobs
within 0.05.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # run from a checkout, installed or not

from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR  # noqa: E402
from loraplex.demo.tasks import held_out_inputs, make_prompt  # noqa: E402

TARGETS = {
    8: ["q_proj", "v_proj"],
    16: ["q_proj", "k_proj", "v_proj", "o_proj"],
    32: ["gate_proj", "up_proj", "down_proj"],
    64: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _tiny_batch(work: Path, device: str, dtype: str) -> list[dict[str, Any]]:
    base = build_hf_model("llama", seed=0, hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    model_dir = save_hf_model(base, work / "model")
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=64, max_num_batched_tokens=512)
    names: list[str | None] = [None]
    for r, targets in TARGETS.items():
        llm.register_adapter(f"r{r}", make_peft_adapter(base, work / f"r{r}", r, targets, seed=r))
        names.append(f"r{r}")
    first = llm.register_adapter("two", make_peft_adapter(base, work / "two-a", 16, TARGETS[16], seed=101))
    llm.register_adapter("two", make_peft_adapter(base, work / "two-b", 8, TARGETS[8], seed=102))
    names += [str(first), "two"]
    rng = random.Random(0)
    prompts, adapters, params = [], [], []
    for i in range(40):
        length = rng.choice([1, 2, 3, 7, 16, 17, 33, 64, 130])
        prompts.append([rng.randrange(3, 97) for _ in range(length)])
        adapters.append(names[i % len(names)])
        if i % 5 == 4:
            params.append(
                SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1000 + i, logprobs=2)
            )
        else:
            params.append(SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, prompt_logprobs=3))
    outs = llm.generate(prompts, params, adapters=adapters)
    return [_record("tiny", i, a, o) for i, (a, o) in enumerate(zip(adapters, outs, strict=True))]


def _demo_batch(device: str, dtype: str) -> list[dict[str, Any]]:
    llm = LLM(DEMO_MODEL_DIR, dtype=dtype, device=device, max_num_seqs=128)
    for name, path in DEMO_ADAPTERS.items():
        llm.register_adapter(name, path)
    models = [None, *DEMO_ADAPTERS]
    inputs = held_out_inputs(60, seed=7)
    adapters = [models[i % len(models)] for i in range(len(inputs))]
    outs = llm.generate(
        [make_prompt(x) for x in inputs], SamplingParams(max_tokens=24, temperature=0.0, logprobs=1), adapters
    )
    return [_record("demo", i, a, o) for i, (a, o) in enumerate(zip(adapters, outs, strict=True))]


def _record(batch: str, i: int, adapter: str | None, out: Any) -> dict[str, Any]:  # noqa: ANN401
    def lps(dicts: list | None) -> list | None:
        if dicts is None:
            return None
        return [None if d is None else sorted([int(t), float(v)] for t, v in d.items()) for d in dicts]

    return {
        "id": f"{batch}-{i}",
        "adapter": adapter,
        "tokens": out.token_ids,
        "logprobs": lps(out.logprobs),
        "prompt_logprobs": lps(out.prompt_logprobs),
    }


def run(device: str) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    dtype = "float32" if device == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        return _tiny_batch(Path(tmp), device, dtype) + _demo_batch(device, dtype)


def check(golden: list[dict[str, Any]], now: list[dict[str, Any]], exact: bool) -> list[str]:
    problems = []
    for want, got in zip(golden, now, strict=True):
        if want["tokens"] != got["tokens"]:
            problems.append(f"{want['id']} ({want['adapter']}): tokens {got['tokens']} != {want['tokens']}")
            continue
        for key in ("logprobs", "prompt_logprobs"):
            for pos, (w, g) in enumerate(zip(want[key] or [], got[key] or [], strict=True)):
                if w is None or g is None:
                    if w != g:
                        problems.append(f"{want['id']} {key}[{pos}]: {g} != {w}")
                    continue
                if [t for t, _ in w] != [t for t, _ in g] and exact:
                    problems.append(f"{want['id']} {key}[{pos}]: top tokens differ")
                    continue
                wd, gd = dict(map(tuple, w)), dict(map(tuple, g))
                for t, v in wd.items():
                    if t in gd and (gd[t] != v if exact else abs(gd[t] - v) > 0.05):
                        problems.append(f"{want['id']} {key}[{pos}] token {t}: {gd[t]!r} != {v!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["record", "check"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--golden", type=Path)
    args = parser.parse_args()
    now = run(args.device)
    if args.mode == "record":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "outputs": now}) + "\n")
        print(f"recorded {len(now)} requests on {args.device} to {args.out}")
        return 0
    golden = json.loads(args.golden.read_text())["outputs"]
    problems = check(golden, now, exact=args.device == "cpu")
    for p in problems[:20]:
        print(p)
    print(
        f"{len(now) - len({p.split()[0] for p in problems})} of {len(now)} requests identical"
        f"{'' if args.device != 'cpu' else ' (bit-identical logprobs)'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
