"""The engine `loraplex bench serve` replays its workload on, built the same way in the bench's
process and in the server it starts for the HTTP comparison (`bench/serve_server.py`): the demo
model with its adapters, a model directory, or random weights made on the device from the
workload's seed (no files, unless transformers + PEFT must load them too), with random adapters of
the workload's ranks and a synthetic tokenizer, so that both sides detokenize and stream text."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loraplex.bench.workloads import Workload, WorkloadRequest, WorkloadSpec


@dataclass(frozen=True)
class ServeBenchArgs:
    workload: WorkloadSpec
    device: str = "cpu"
    model: str | None = None  # a model directory; None: the demo model (smoke) or random weights
    random_layers: int | None = None  # random Llama-3-8B-shaped weights with this many layers
    random_shape: str = "llama3-8b"  # or "tiny" (a CPU-sized model of the same architecture)
    workdir: str = "bench-results/serve-checkpoint"  # random weights as files, for --hf-compare
    max_num_seqs: int = 64
    # engine settings worth comparing in one run (None: the engine's default)
    max_num_batched_tokens: int | None = None
    graph_max_tokens: int | None = None  # rows of the largest step with prefill that replays a graph
    admission_batch_tokens: int | None = None
    dtype: str | None = None  # None: bfloat16 (random weights; a model directory's off the CPU), else float32
    prefix_caching: bool = True
    base_compare: bool = True
    url: str | None = None  # benchmark a running server instead
    api_key: str | None = None
    smoke: bool = False
    warmup_requests: int = 8  # replayed untimed before the measured runs (in-process)
    hf_compare: bool = False  # also run transformers + PEFT (needs a model and adapter directories)
    # transformers + PEFT on the workload's first N requests only (None: all), in whole batches:
    # its throughput over a few static batches is its throughput, at a fraction of the time
    hf_requests: int | None = None
    # stop transformers + PEFT after this many seconds of generation and report its measured pace and
    # the bound it gives (None: run to the end)
    hf_time_limit_s: float | None = None
    # Also the same workload over HTTP, against a server on the same engine that the bench starts
    # in a process of its own (bench/serve_server.py); the report states HTTP / in-process.
    http_compare: bool = False
    # After the main runs, on the same engine: the workload again with each of these seeds, and
    # with Poisson arrivals at this fraction of the first closed-loop run's request rate (each
    # with adapters, and base-only unless base_compare is off).
    more_seeds: tuple[int, ...] = ()
    poisson_factor: float | None = None
    # Then the workload base-only at each of these step token budgets (admission batching off),
    # on the same engine: which budget hides prefill under decode best.
    budget_sweep: tuple[int, ...] = ()
    step_records: bool = False  # every step's record in each run's summary (`step_records`)

    @classmethod
    def smoke_args(cls, **overrides: Any) -> ServeBenchArgs:  # noqa: ANN401
        """The CPU demo model: its four adapters, prompts and outputs that fit its 64-token context."""
        spec = WorkloadSpec(
            seed=0,
            num_requests=48,
            num_adapters=4,
            popularity="zipf:1.0",
            base_share=0.2,
            prompt_len="uniform:4:24",
            output_len="uniform:8:32",
            arrivals="closed:8",
        )
        return replace(cls(workload=spec, max_num_seqs=16, smoke=True), **overrides)


def prompt_ids(req: WorkloadRequest, vocab: int, seed: int) -> list[int]:
    """The random prompt of a request without a text prompt (the same in every run of the seed)."""
    rng = random.Random(seed * 1_000_003 + req.index)
    return [rng.randrange(4, vocab) for _ in range(req.prompt_len)]


def bench_tokenizer(vocab_size: int) -> Any:  # noqa: ANN401
    """A word-level tokenizer over the whole vocabulary ("w0" .. "wN", space-separated), for random
    weights: every token has text, so the engine detokenizes and the server streams every token,
    as with a real model. transformers' fast-tokenizer wrapper, as a model directory's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="w1", eos_token="w2")


def _sized_config(args: ServeBenchArgs, workload: Workload, model_dir: str, dtype: str, sched: Any) -> Any:  # noqa: ANN401
    """An engine config whose context fits the workload's longest request and whose LoRA rank
    limit fits its adapters."""
    from loraplex.config import CacheConfig, EngineConfig, GraphConfig, LoRAConfig

    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    return EngineConfig(
        model_dir=model_dir,
        dtype=dtype,
        device=args.device,
        cache=CacheConfig(
            block_size=16, max_model_len=longest + 1, enable_prefix_caching=args.prefix_caching
        ),
        lora=LoRAConfig(max_rank=max([64, *workload.adapter_ranks])),
        scheduler=sched,
        graphs=GraphConfig(cuda_graph_max_tokens=args.graph_max_tokens),
    )


def build_engine(args: ServeBenchArgs, workload: Workload) -> tuple[Any, list[str], dict[str, str]]:  # noqa: ANN401
    """The engine, the adapter name of each adapter index, and the directory of each adapter
    that came from one (the transformers + PEFT baseline loads those)."""
    import torch

    from loraplex.config import CacheConfig, EngineConfig, GraphConfig, SchedulerConfig
    from loraplex.engine.engine import Engine

    spec = args.workload
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    if args.admission_batch_tokens is not None:
        sched = replace(sched, admission_batch_tokens=args.admission_batch_tokens)
    graphs = GraphConfig(cuda_graph_max_tokens=args.graph_max_tokens)
    if args.smoke or (args.model is None and args.random_layers is None):
        from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

        config = EngineConfig(
            model_dir=str(DEMO_MODEL_DIR),
            device=args.device,
            dtype=args.dtype or "float32",
            cache=CacheConfig(enable_prefix_caching=args.prefix_caching),
            scheduler=sched,
            graphs=graphs,
        )
        engine = Engine(config)
        demo = list(DEMO_ADAPTERS.items())
        names = []
        for i in range(spec.num_adapters):
            name, path = demo[i % len(demo)]
            names.append(engine.register_adapter(name, path).name)
        return engine, names, {name: str(path) for name, path in demo}
    if args.model is not None:
        cache = CacheConfig(enable_prefix_caching=args.prefix_caching)
        config = EngineConfig(args.model, device=args.device, dtype=_dir_dtype(args), cache=cache)
        config = replace(config, scheduler=sched, graphs=graphs)
        engine = Engine(config)
    else:
        from loraplex.bench.random_weights import llama3_8b_hf_dict, random_model, tiny_hf_dict
        from loraplex.config import ModelConfig

        if args.random_shape not in ("llama3-8b", "tiny"):
            raise ValueError(f"unknown random shape {args.random_shape!r}; use llama3-8b or tiny")
        hf_dict = (tiny_hf_dict if args.random_shape == "tiny" else llama3_8b_hf_dict)(args.random_layers)
        if args.hf_compare:
            return _from_checkpoint(args, workload, hf_dict, sched)
        mc = ModelConfig.from_hf_dict(hf_dict)
        config = _sized_config(args, workload, "<random weights>", args.dtype or "bfloat16", sched)
        model = random_model(mc, config.torch_dtype, torch.device(args.device), spec.seed)
        engine = Engine(config, model=model, tokenizer=bench_tokenizer(mc.vocab_size))
    from loraplex.bench.random_weights import random_adapter

    names = []
    for i, rank in enumerate(workload.adapter_ranks):
        imported = random_adapter(
            engine.model_config, rank, 1000 + i, engine.config.torch_dtype, engine.device
        )
        names.append(engine.register_imported(f"bench-{i}", imported).name)
    return engine, names, {}


def _from_checkpoint(
    args: ServeBenchArgs, workload: Workload, hf_dict: dict[str, Any], sched: Any
) -> tuple[Any, list[str], dict[str, str]]:  # noqa: ANN401
    """Random weights written as files first, so that transformers + PEFT load the same ones."""
    from loraplex.bench.serve_checkpoint import write_random_checkpoint
    from loraplex.engine.engine import Engine

    model_dir, adapter_dirs = write_random_checkpoint(
        hf_dict, workload.adapter_ranks, Path(args.workdir), args.device, args.workload.seed
    )
    engine = Engine(_sized_config(args, workload, model_dir, _dir_dtype(args), sched))
    names = [engine.register_adapter(name, path).name for name, path in adapter_dirs.items()]
    return engine, names, adapter_dirs


def _dir_dtype(args: ServeBenchArgs) -> str:
    """A model directory's dtype: as asked, else float32 on the CPU and bfloat16 elsewhere."""
    return args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
