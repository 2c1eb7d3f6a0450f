"""The engine: requests in, one batched step at a time, tokens out.

    step() = schedule (ids) -> run the model (tensors) -> sample -> postprocess (stop checks)
    step_overlapped(): the serving loops' step, one ahead (engine/step_pipeline.py)

Requests of any adapter (or none) share each step; every request keeps the adapter revision it
was admitted with until it finishes or is aborted.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loraplex import kernel_compiles
from loraplex.adapters.base_identity import (
    BaseIdentity,
    config_revision,
    declared_identity,
    directory_identity,
)
from loraplex.adapters.peft_import import ImportedAdapter, import_peft_adapter
from loraplex.adapters.registry import DEFAULT_TENANT, AdapterRegistry, check_adapter_name
from loraplex.adapters.residency import StepSlots
from loraplex.adapters.tier_setup import build_tiers
from loraplex.config import EngineConfig, ModelConfig, dtype_warning
from loraplex.engine.adapter_admission import AdapterAdmission
from loraplex.engine.cuda_graphs import StaticStepRunner, graph_limits
from loraplex.engine.gc_pacing import GcPacer, freeze_long_lived
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.prompt_tokens import eos_token_ids, prompt_token_ids
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.engine.stats import StepStats
from loraplex.engine.step_pipeline import InFlightStep, StepPipeline
from loraplex.engine.stop import StopChecker
from loraplex.engine.warmup import warm_up
from loraplex.kv.accounting import check_kv_accounting
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.kv_cache import PagedKVCache
from loraplex.kv.prefix_cache import PrefixCache
from loraplex.lora.backend import make_lora_backend
from loraplex.lora.weights import LoRASlotTable
from loraplex.model.llama import LlamaFamilyModel
from loraplex.model.loader import load_model
from loraplex.model.tokenizer import load_tokenizer
from loraplex.types import AdapterRef, RequestOutput, SamplingParams


class Engine(StepPipeline):
    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        model: LlamaFamilyModel | None = None,
        base_revision: str | None = None,
        tokenizer: Any = None,  # noqa: ANN401
    ) -> None:
        """Load the model from `config.model_dir`, or serve `model` as given (already on
        `config.device` in `config.dtype`; its `config` is the ModelConfig, `config.model_dir` is
        not read, and the tokenizer is `tokenizer`: with None, prompts must be token ids and
        outputs have no text). `base_revision`: the declared base revision of an in-process `model`
        (default: one derived from its config); a model directory's is the hash of its files (`base`)."""
        self.config = config
        self._base: BaseIdentity | None = None
        if model is not None:
            self._base = declared_identity("in-process", base_revision or config_revision(model.config))
        elif base_revision is not None or tokenizer is not None:
            raise ValueError("base_revision and tokenizer are given only with an in-process model")
        self.device = torch.device(config.device)
        dtype = config.torch_dtype
        slow = dtype_warning(self.device, dtype)
        if slow is not None:
            print(f"warning: {slow}", file=sys.stderr)
        if model is None:
            self.model_config = ModelConfig.from_dir(config.model_dir)
            self.model = load_model(config.model_dir, dtype, self.device, progress=progress)
            self.tokenizer = load_tokenizer(Path(config.model_dir))
        else:
            self.model_config = model.config
            self.model = model
            self.tokenizer = tokenizer
        mc = self.model_config
        self.max_model_len = config.cache.max_model_len or mc.max_position_embeddings
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or (
            config.scheduler.max_num_seqs * -(-self.max_model_len // block_size)
        )
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size) if config.cache.enable_prefix_caching else None
        self.kv = PagedKVCache(
            mc.num_hidden_layers,
            num_blocks,
            block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype,
            self.device,
        )
        self.lora_table = LoRASlotTable(mc.num_hidden_layers, dtype, config.lora.max_resident)
        self.lora_backend = make_lora_backend(self.device)
        if self.device.type == "cuda":
            kernel_compiles.install()
        self.adapters = AdapterRegistry()  # which revisions exist, and who holds them
        # Where their weights are: device pool and host tier, loaded on demand.
        self.tiers = build_tiers(self.lora_table, self.device, config.lora, self._demand)
        self.residency = self.tiers.residency
        # Registration, admission and the scheduler's gate: the adapter side of each request.
        self.admission = AdapterAdmission(self.adapters, self.tiers, lambda: self.base)
        # The plan's slot map from residency; its slots stay pinned until `residency.end_step()`.
        self.slot_map: Callable[[StepPlan], StepSlots] = self.admission.slot_map
        sc = config.scheduler
        self.scheduler = Scheduler(
            sc,
            self.pool,
            block_size,
            self.admission.ready,
            sc.admission_batch_tokens,
            prefix=self.prefix_cache,
        )
        self.scheduler.max_model_len = self.max_model_len
        self.scheduler.resident = self._resident
        self.tiers.reserved = self.scheduler.drain_reservation
        if self.prefix_cache is not None:
            self.admission.drop_cached = self.prefix_cache.drop_revision
        self.runner = ModelRunner(
            self.model, self.kv, self.lora_table, self.lora_backend, self.device, self._static_steps(config)
        )
        # every kernel variant and CUDA graph, before the first request (engine/warmup.py)
        self.warmup_s = warm_up(self, config, progress)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.stop = StopChecker(self.tokenizer, eos_token_ids(self.model_config, self.tokenizer))
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # Live requests with max_tokens=0: while there are none, a step does no per-row check for them.
        self._num_scoring = 0
        self.last_stats: StepStats | None = None
        self._in_flight: deque[InFlightStep] = deque()  # launched steps not yet completed, oldest first
        self.gc_pacer = GcPacer()  # collections where a step is in flight (step_overlapped)
        # The model and tables are built: collect once and move everything alive now out of the
        # collector's reach, so no full collection over them lands inside a step later.
        freeze_long_lived()

    @property
    def base(self) -> BaseIdentity:
        """The served base's identity (hashed on first use unless `identify_base` ran)."""
        return self._base or self.identify_base(None)

    def identify_base(self, cache_file: Path | None) -> BaseIdentity:
        """Hash the model directory's config and weights now (`cache_file`: the stat cache the
        server keeps in its data directory); an in-process model keeps its declared revision."""
        if self._base is None:
            self._base = directory_identity(self.config.model_dir, cache_file)
        return self._base

    # --- requests -------------------------------------------------------------------------------

    def register_adapter(self, name: str, path: str | Path) -> AdapterRef:
        """Import a PEFT adapter directory under `name`; raises ValueError naming any problem and
        changes nothing in that case."""
        check_adapter_name(name)
        return self.register_imported(
            name, import_peft_adapter(path, self.model_config, self.config.lora.max_rank, self.base)
        )

    def register_imported(
        self,
        name: str,
        imported: ImportedAdapter,
        revision: str | None = None,
        tenant: str = DEFAULT_TENANT,
        visibility: str = "shared",
    ) -> AdapterRef:
        """Register already imported (normalized, verified) weights: load them, then name them.
        `revision`: the content's revision when the caller computed it already (the control plane
        does, off this thread: hashing a large adapter here would hold up every step)."""
        ref = self.admission.register(name, imported, revision, tenant, visibility)
        freeze_long_lived()  # its weights live until retired: no full collection walks them again
        return ref

    def retire_adapter(self, ref: AdapterRef) -> None:
        """Take a revision out of service: new requests are refused, running ones finish on it, and
        when the last one ends (now, if none runs) its slot is freed and `admission.on_drained`
        is told."""
        self.admission.retire(ref)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | AdapterRef | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        """Validate, resolve the adapter to an immutable revision, and queue the request.
        `cache_salt`: only requests with the same salt share prefix-cache blocks. The adaptive
        scheduler policy (engine/policies.py) serves tenants fairly, orders a tenant's requests by
        `priority` (higher first), and puts one whose first token is due within `deadline_s`
        (seconds from now) ahead when the deadline nears; FCFS ignores all three.

        Raises ValueError (nothing is queued or held) for a duplicate id, an empty or too long
        prompt, out-of-vocabulary token ids, an unknown adapter, or a deadline that is not a
        positive number of seconds. A prompt may fill the context length only when
        `params.max_tokens` is 0 (scoring: nothing is generated after it).
        """
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if deadline_s is not None and not 0 < deadline_s < math.inf:  # (NaN fails too)
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        limit = self.max_model_len
        if len(token_ids) > limit or (params.max_tokens and len(token_ids) == limit):
            room = " and leaves no room for a generated token" if len(token_ids) == limit else ""
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context length is {limit}{room}")
        worst_case = min(len(token_ids) + params.max_tokens, limit)
        if self.scheduler.blocks_for(worst_case) > self.pool.num_blocks:
            raise ValueError(
                f"request needs up to {worst_case} tokens of KV cache, more than the pool's "
                f"{self.pool.num_blocks * self.kv.block_size}"
            )
        ref, tier = self.admission.acquire(adapter)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id, token_ids, params, ref, next(self._arrivals), generator, priority=priority)
        if tenant is not None:
            seq.tenant = tenant
        if deadline_s is not None:
            seq.deadline = self.scheduler.clock() + deadline_s
            seq.deadline_s = deadline_s
        self.admission.admitted(seq, tier)
        if self.prefix_cache is not None:  # seeded by revisions, never names (kv/prefix_cache.py)
            entry = self.adapters.resolve(ref) if ref is not None else None  # just acquired: live
            base = self._base.revision if self._base is not None else None
            seq.cache_seed = self.prefix_cache.seed(base, entry, cache_salt)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        if not params.max_tokens:
            self._num_scoring += 1

    def abort(self, request_id: str) -> bool:
        """Stop a request now, freeing its KV blocks and its hold on the adapter revision."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = "abort"
        self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def output(self, request_id: str, copy_prompt: bool = True) -> RequestOutput:
        """A snapshot of the request. With copy_prompt=False its prompt_token_ids is the engine's
        own list (never changed after admission; callers must not change it either): the server
        takes a snapshot per request per step, and copying a long prompt each time adds up."""
        seq = self._seqs[request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids) if copy_prompt else seq.prompt_token_ids,
            adapter=seq.adapter,
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
        )

    def sequence(self, request_id: str) -> Sequence:
        """The request's live state, not a copy: for the engine's own thread, to read only."""
        return self._seqs[request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request's state (call after reading its output)."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.is_finished:
            del self._seqs[request_id]

    def _resident(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter is on the device now (starting no load)."""
        return seq.adapter is None or self.residency.is_resident(seq.adapter.revision)

    def _demand(self) -> tuple[list[AdapterRef | None], list[AdapterRef | None]]:
        """The adapters of the running and of the waiting sequences (for choosing victims)."""
        return [s.adapter for s in self.scheduler.running], [s.adapter for s in self.scheduler.waiting]

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants: KV accounting with shared blocks (`kv/accounting.py`)
        and adapter holds equal to the live requests on each revision. Tests call it between steps."""
        live = [s for s in self._seqs.values() if not s.is_finished]
        check_kv_accounting(self.pool, live, self.kv.block_size, self.adapters.in_service)
        assert self._num_scoring == sum(not s.params.max_tokens for s in live), "scoring request count"
        self.admission.check_integrity(live)

    # --- helpers --------------------------------------------------------------------------------

    def _static_steps(self, config: EngineConfig) -> StaticStepRunner | None:
        """CUDA graphs for decode and mixed steps on CUDA unless turned off (cuda_graph_max_batch = 0)."""
        max_batch, max_tokens = graph_limits(config)
        if self.device.type != "cuda" or max_batch == 0:
            return None
        return self.static_step_runner(max_batch, capture=True, max_tokens=max_tokens)

    def static_step_runner(self, max_batch: int, capture: bool, max_tokens: int = 0) -> StaticStepRunner:
        """A static-step runner over this engine's model, KV cache and LoRA table (capture=False:
        the static buffers without CUDA graphs, as tests and benches on the CPU use them;
        max_tokens 0: decode steps only)."""
        return StaticStepRunner(
            self.model,
            self.kv,
            self.lora_table,
            self.lora_backend,
            self.device,
            max_batch,
            self.max_model_len,
            capture=capture,
            max_tokens=max_tokens,
        )

    @property
    def graph_replays(self) -> int:
        """Steps that ran as CUDA-graph replays (0 without graphs)."""
        sd = self.runner.static_steps
        return sd.replays if sd is not None and sd.capture else 0

    @property
    def kernel_compiles(self) -> int:
        """The project's Triton kernels compiled in this process so far (every engine's)."""
        return kernel_compiles.count()

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (one per new step shape; none after a startup warm-up)."""
        sd = self.runner.static_steps
        return sd.captures if sd is not None else 0
