"""Frozen configuration dataclasses.

`ModelConfig` is read from a Hugging Face `config.json`; the others are engine knobs with defaults
that suit the CPU reference path. Derived values are properties, never stored twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from None


def dtype_warning(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """What an engine says at startup about a dtype that serves far slower than it need: float32
    on CUDA runs its GEMMs in full float32 (TF32 stays off, so outputs match a float32 reference)
    and its attention and LoRA kernels in IEEE float32 too."""
    if torch.device(device).type == "cuda" and dtype == torch.float32:
        return (
            "float32 on CUDA runs every matrix product in full float32 (no TF32): many times slower "
            "than bfloat16 (on an H200, bench prefix's cold TTFT is ~30x bf16's). It is meant for "
            "checks against a float32 reference; serve in bfloat16 or float16"
        )
    return None


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters normalised from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if params and any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type RoPE parameters are not supported")
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"unsupported RoPE scaling type {rope_type!r} (supported: default, linear, llama3)"
            )
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        original = params.get(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192)),
        )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2 always; Llama when attention_bias is set)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    layer_sliding_windows: tuple[int | None, ...]  # per layer: attend to the last N positions, or all
    rope: RopeConfig
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a model directory: config.json not found")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        n_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // n_heads
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        n_layers = int(raw["num_hidden_layers"])
        window = raw.get("sliding_window")
        # Mistral applies its window to every layer whenever one is configured; Qwen2/3 only with
        # use_sliding_window, from max_window_layers on (or as `layer_types` says).
        if arch == "MistralForCausalLM":
            layer_windows = (int(window) if window else None,) * n_layers
        elif raw.get("use_sliding_window", False) and window:
            types = raw.get("layer_types") or [
                "sliding_attention" if i >= int(raw.get("max_window_layers", 0)) else "full_attention"
                for i in range(n_layers)
            ]
            layer_windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
        else:
            layer_windows = (None,) * n_layers
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=(not is_qwen2) and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_sliding_windows=layer_windows,
            rope=RopeConfig.from_hf(raw),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every LoRA-targetable projection, by target name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q": (h, self.q_size),
            "k": (h, self.kv_size),
            "v": (h, self.kv_size),
            "o": (self.q_size, h),
            "gate": (h, i),
            "up": (h, i),
            "down": (i, h),
        }


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from max_num_seqs * max_model_len
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # The prefix cache (`kv/prefix_cache.py`): full KV blocks reused by later requests with the
    # same base and adapter revisions, salt and prefix. Off: every prompt is computed in full.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")


@dataclass(frozen=True)
class LoRAConfig:
    max_rank: int = 64
    # Adapters the device tables hold before they must be reallocated, which makes every
    # captured decode graph be captured again (more still work, at that one-time cost).
    max_resident: int = 64
    # Byte budgets of the adapter tiers (flags --adapter-device-bytes / --adapter-host-bytes). The
    # device pool is preallocated at startup (host memory on the CPU); None: 1 GiB on the CPU, a
    # quarter of the GPU memory free after the model and KV cache on CUDA. The host cache holds
    # adapters evicted from the device or read from the store; None: 4 GiB.
    adapter_device_bytes: int | None = None
    adapter_host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_rank <= 0:
            raise ValueError("max_rank must be positive")
        if self.max_resident <= 0:
            raise ValueError("max_resident must be positive")
        if self.adapter_device_bytes is not None and self.adapter_device_bytes < 16:
            raise ValueError(f"adapter_device_bytes must be at least 16, got {self.adapter_device_bytes}")
        if self.adapter_host_bytes is not None and self.adapter_host_bytes < 0:
            raise ValueError(f"adapter_host_bytes must be >= 0, got {self.adapter_host_bytes}")


# The default step token budget. Steps with prefill beside a full batch of decode rows: on an H200
# (Llama-3-8B shape, 64 sequences; docs/bench.md, "Step token budget") the base GEMMs of 64 rows
# are memory-bound, and from ~200 rows on compute-bound, where more prefill per step adds its full
# compute and lengthens the steps every decoding request waits for. Budgets 256 / 320 / 384 gave
# 0.576 / 0.589 / 0.596 of pure decode's output tokens/s; 512 and 2048 less (0.53-0.55, in runs
# whose wall also held profiler stalls). Per sequence, so that the prefill room grows with the
# completions a larger batch brings; a lone long prompt on an idle engine pays for it in more steps.
DEFAULT_TOKENS_PER_SEQ = 6
DEFAULT_MIN_STEP_TOKENS = 384


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget of one step (prefill chunks + decode rows); None: `step_token_budget`'s default.
    max_num_batched_tokens: int | None = None
    # Admission batching: a step that would otherwise be pure decode admits new prompts only once
    # their tokens add up to this many, or the oldest has waited `admission_max_wait_ms`. 0 (the
    # default): every arrival is admitted at once. It paid while steps with prefill ran eagerly
    # (a fixed host cost per step); they replay graphs now, and on the H200 it only delays first
    # tokens (docs/bench.md).
    admission_batch_tokens: int = 0
    admission_max_wait_ms: int = 50
    # Admission order, i.e. which prefills start (engine/policies.py): "fcfs" (arrival order) or
    # "adaptive" (tenant fairness, priority, deadlines, adapter locality, a starvation bound); the
    # knobs below are adaptive's.
    policy: str = "fcfs"
    # The running set (engine/decode_policies.py): which running sequences are preempted when KV
    # blocks or slots are short. "fcfs": the latest admitted; "adaptive": one of the tenant most
    # over its share of the slots (lowest priority, then latest), and a tenant under its share
    # whose request waited `displace_after_ms` may take a slot from it. None: the same as `policy`.
    decode_policy: str | None = None
    displace_after_ms: int = 500
    # A request that would bring a new adapter into the step waits up to this long for
    # same-adapter company, unless `locality_group` requests of its adapter already wait, or its
    # adapter left the running set less than `locality_popular_ms` ago (a popular adapter between
    # requests: holding those only moves its tail latency; in the simulator a 150 ms window
    # without it gave the hot adapter 2.5x FCFS's P99 TTFT, docs/bench.md).
    locality_window_ms: int = 150
    locality_group: int = 2
    locality_popular_ms: int = 500
    # Nor are requests of the most requested adapters: the top `locality_top_share` of the adapters
    # by recent arrival rate (their users are most of the traffic; holding them only moves the
    # P99 TTFT most requests see).
    locality_top_share: float = 0.1
    max_adapters_per_step: int = 0  # distinct adapters admitted into a step; 0: no cap beyond max_num_seqs
    max_wait_ms: int = 5000  # starvation bound: a request that waited this long is admitted first
    deadline_slack_ms: int = 100  # a deadline this close makes a request urgent (before fairness)
    tenant_weights: str = ""  # "a:3,b:1": shares of service when backlogged; others weigh 1

    @property
    def step_token_budget(self) -> int:
        """Rows one step may carry: `max_num_batched_tokens`, else DEFAULT_TOKENS_PER_SEQ rows per
        sequence and at least DEFAULT_MIN_STEP_TOKENS."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MIN_STEP_TOKENS, DEFAULT_TOKENS_PER_SEQ * self.max_num_seqs)

    @property
    def running_policy(self) -> str:
        """The decode-side policy in force: `decode_policy`, or `policy` when that is unset."""
        return self.decode_policy or self.policy

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "adaptive"):
            raise ValueError(f"policy must be fcfs or adaptive, got {self.policy!r}")
        if self.decode_policy not in (None, "fcfs", "adaptive"):
            raise ValueError(f"decode_policy must be fcfs or adaptive, got {self.decode_policy!r}")
        knobs = (
            self.locality_window_ms,
            self.locality_popular_ms,
            self.max_adapters_per_step,
            self.max_wait_ms,
            self.deadline_slack_ms,
            self.displace_after_ms,
        )
        if min(knobs) < 0 or self.locality_group < 1:
            raise ValueError("the adaptive policy's knobs must be >= 0 (locality_group >= 1)")
        if not 0.0 <= self.locality_top_share <= 1.0:
            raise ValueError(f"locality_top_share must be in [0, 1], got {self.locality_top_share}")
        if self.max_num_seqs <= 0 or self.step_token_budget <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.admission_batch_tokens < 0:
            raise ValueError("admission_batch_tokens must be >= 0 (0 admits every arrival at once)")
        if self.admission_max_wait_ms < 0:
            raise ValueError("admission_max_wait_ms must be >= 0")


@dataclass(frozen=True)
class GraphConfig:
    # Steps of up to this many sequences replay CUDA graphs (decode steps per batch-size bucket,
    # steps with prefill chunks per token bucket); 0 runs every step eagerly. Only on CUDA.
    cuda_graph_max_batch: int = 256
    # Steps with prefill chunks of up to this many rows replay graphs (None: the scheduler's
    # token budget; 0: only pure decode steps do).
    cuda_graph_max_tokens: int | None = None
    # Capture every graph (each shape, base-only and every LoRA shape up to the maximum rank)
    # when the engine starts, so none is captured while it serves; False: on first use.
    capture_at_startup: bool = True

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch < 0:
            raise ValueError("cuda_graph_max_batch must be >= 0 (0 turns CUDA graphs off)")
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be >= 0 (0: only decode steps replay graphs)")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor parallelism is not implemented yet (tensor_parallel_size must be 1)")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
