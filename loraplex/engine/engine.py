"""The engine: requests in, one batched step at a time, tokens out.

    step() = schedule (ids) -> run the model (tensors) -> sample -> postprocess (stop checks)

Requests of any adapter (or none) share each step; every request keeps the adapter revision it
was admitted with until it finishes or is aborted.
"""

from __future__ import annotations

import gc
import itertools
import operator
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

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
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.tiers import build_tiers
from loraplex.config import EngineConfig, ModelConfig
from loraplex.engine.cuda_graphs import StaticDecodeRunner
from loraplex.engine.model_runner import ForwardResult, ModelRunner
from loraplex.engine.sampler import Sampler, logprob_dicts
from loraplex.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.stats import StepStats
from loraplex.engine.stop import StopChecker
from loraplex.host_to_device import to_device
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.kv_cache import PagedKVCache
from loraplex.lora.backend import make_lora_backend
from loraplex.lora.weights import LoRASlotTable
from loraplex.model.llama import LlamaFamilyModel
from loraplex.model.loader import load_model
from loraplex.model.tokenizer import load_tokenizer
from loraplex.types import AdapterRef, RequestOutput, SamplingParams

# a scheduled chunk's adapter, in C (`map` over a step's chunks costs less than a comprehension)
_ADAPTER_OF_CHUNK = operator.attrgetter("seq.adapter")


class RequestDelta(NamedTuple):
    """What one step produced for one request. (A NamedTuple: a step makes one per row, and
    building one costs half of what a frozen dataclass's __init__ does.)"""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
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
        self._last_slot_map: tuple[tuple[ScheduledChunk, ...], int, StepSlots] | None = None
        self.scheduler = Scheduler(
            config.scheduler, self.pool, block_size, self._adapter_ready, _admission_batch_tokens(config)
        )
        self.runner = ModelRunner(
            self.model, self.kv, self.lora_table, self.lora_backend, self.device, self._static_decode(config)
        )
        self.warmup_s = self._warm_up(config, progress)  # before the first request, with a progress bar
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.stop = StopChecker(self.tokenizer, self._eos_ids())
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # Live requests with max_tokens=0: while there are none, a step does no per-row check for them.
        self._num_scoring = 0
        self.last_stats: StepStats | None = None
        # Called on this thread when the last request on a retired revision ends (the server
        # records the retirement; it must not block).
        self.on_adapter_drained: Callable[[AdapterRef], None] | None = None
        # The model and tables are built: collect once and move everything alive now out of the
        # collector's reach, so no full collection over them lands inside a step later.
        gc.collect()
        gc.freeze()

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
        check_adapter_name(name)
        made_for = imported.manifest.get("base_revision")
        if made_for is not None and made_for != self.base.revision:
            raise ValueError(
                f"base model mismatch: {name} was made for base revision {made_for!r}, this engine "
                f"serves {self.base.revision!r}"
            )
        revision = revision or adapter_revision(imported)
        if self.adapters.is_retired(AdapterRef(name, revision)):  # before loading: nothing changes
            raise ValueError(f"{name}@{revision[:12]} is retired; a retired revision stays retired")
        weights = self.tiers.register(revision, imported.weights, tenant)
        return self.adapters.add(
            name, revision, weights.max_rank, weights.nbytes, imported.manifest, tenant, visibility
        )

    def retire_adapter(self, ref: AdapterRef) -> None:
        """Take a revision out of service: new requests are refused, running ones finish on it, and
        when the last one ends (now, if none runs) its slot is freed."""
        if self.adapters.retire(ref):
            self._drained(ref)

    def _drained(self, ref: AdapterRef) -> None:
        """No request holds the retired `ref` any more: free its slot unless another name still
        serves the same content, and tell the server (which records the retirement)."""
        if not self.adapters.in_service(ref.revision):
            self.tiers.drop(ref.revision)
        if self.on_adapter_drained is not None:
            self.on_adapter_drained(ref)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | AdapterRef | None = None,
    ) -> None:
        """Validate, resolve the adapter to an immutable revision, and queue the request.

        Raises ValueError (nothing is queued or held) for a duplicate id, an empty or too long
        prompt, out-of-vocabulary token ids, or an unknown adapter. A prompt may fill the context
        length only when `params.max_tokens` is 0 (scoring: nothing is generated after it).
        """
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self._tokenize(prompt)
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
        ref = self.adapters.acquire(adapter)
        if ref is not None:
            try:
                self.tiers.admit(ref.revision)
            except Exception:
                self.adapters.release(ref)
                raise
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id, token_ids, params, ref, next(self._arrivals), generator)
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
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request's state (call after reading its output)."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.is_finished:
            del self._seqs[request_id]

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        failed: list[RequestDelta] = []
        if self.tiers.busy:  # place finished adapter loads, between steps (no slot is pinned)
            self.tiers.poll()
            failed = self._fail_loads(self.tiers.take_failures())
        plan = self.scheduler.schedule()
        if not plan.chunks:
            self.last_stats = None
            if self.tiers.busy:
                self.tiers.wait(0.002)  # only loads to wait for: let the loader thread run
            return failed
        calls_before = self.lora_backend.total_calls
        # The step's slot map, its slots pinned while it runs (only scheduled sequences pin).
        slots = self.slot_map(plan)
        try:
            self.residency.check(slots)
            result = self.runner.run(plan, slots)
        finally:
            self.residency.end_step()
        deltas = self._postprocess(plan, result)
        if failed:
            deltas = failed + deltas
        self.last_stats = StepStats.of(
            plan,
            result.num_adapters,
            self.lora_backend.total_calls - calls_before,
            self.scheduler,
            self.pool,
            result.static_replay,
        )
        return deltas

    def slot_map(self, plan: StepPlan) -> StepSlots:
        """The plan's slot map from residency; its slots stay pinned until `residency.end_step()`.
        The last step's map is reused when the plan has the same chunks (identical objects: a
        steady decode batch) and no slot changed since; comparing the chunk tuples is a C loop of
        identity checks, a fraction of a new map's cost (4 µs at 64 rows on a slow CPU)."""
        chunks, residency = plan.chunks, self.residency
        last = self._last_slot_map
        if last is not None and last[0] == chunks and last[1] == residency.version:
            residency.repin(last[2])
            return last[2]
        slots = residency.step_slots(map(_ADAPTER_OF_CHUNK, chunks))
        self._last_slot_map = (chunks, residency.version, slots)
        return slots

    def _postprocess(self, plan: StepPlan, result: ForwardResult) -> list[RequestDelta]:
        if result.prompt_rows:
            self._record_prompt_logprobs(plan, result)
        chunks = plan.chunks
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
        if not result.sample_chunks:
            return []
        seqs = [chunks[i].seq for i in result.sample_chunks]
        logits = result.sample_logits
        deltas: list[RequestDelta] = []
        add = deltas.append
        if self._num_scoring:
            seqs, logits = self._finish_scoring(seqs, logits, deltas)
            if not seqs:
                return deltas
        sampled = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        # Per row: the token, its logprobs, the stop checks, the delta; nothing else.
        check = self.stop.check
        max_len = self.max_model_len
        finished = SequenceStatus.FINISHED
        for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
            seq.output_token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            reason = check(seq, max_len)
            if reason is not None:
                seq.finish_reason = reason
                self._finish(seq)
            add(RequestDelta(seq.request_id, [token], seq.status is finished, seq.finish_reason))
        return deltas

    def _finish_scoring(
        self, seqs: list[Sequence], logits: torch.Tensor, deltas: list[RequestDelta]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Finish the max_tokens=0 requests among `seqs` (their prompts are now computed) and return
        the others with their logits rows. The finished rows never reach the sampler: a row there
        would take its share of the shared generator's draw and shift every other row's noise."""
        keep = [i for i, s in enumerate(seqs) if s.params.max_tokens]
        if len(keep) == len(seqs):
            return seqs, logits
        for seq in seqs:
            if not seq.params.max_tokens:
                seq.finish_reason = "length"
                self._finish(seq)
                deltas.append(RequestDelta(seq.request_id, [], True, "length"))
        if not keep:
            return [], logits[:0]
        rows = to_device(keep, torch.int64, logits.device)
        return [seqs[i] for i in keep], logits.index_select(0, rows)

    def _record_prompt_logprobs(self, plan: StepPlan, result: ForwardResult) -> None:
        if not result.prompt_rows:
            return
        lps = torch.log_softmax(result.prompt_logits, dim=-1)
        seqs = [plan.chunks[r.chunk].seq for r in result.prompt_rows]
        actual = [s.prompt_token_ids[r.position] for s, r in zip(seqs, result.prompt_rows, strict=True)]
        dicts = logprob_dicts(lps, actual, [s.params.prompt_logprobs for s in seqs])
        for seq, d in zip(seqs, dicts, strict=True):
            seq.prompt_logprobs.append(d)

    def _fail_loads(self, failures: dict[str, str]) -> list[RequestDelta]:
        """Abort the waiting requests whose adapter could not be loaded (the store lost it, or it
        outgrows the device budget); the reason goes to stderr, the request ends as aborted."""
        if not failures:
            return []
        doomed = [s for s in self.scheduler.waiting if s.adapter and s.adapter.revision in failures]
        for revision, why in failures.items():
            print(f"adapter revision {revision[:12]} failed to load: {why}", file=sys.stderr)
        for seq in doomed:
            seq.finish_reason = "abort"
            self._finish(seq)
        return [RequestDelta(s.request_id, [], True, "abort") for s in doomed]

    def _demand(self) -> tuple[list[AdapterRef | None], list[AdapterRef | None]]:
        """The adapters of the running and of the waiting sequences (for choosing victims)."""
        return [s.adapter for s in self.scheduler.running], [s.adapter for s in self.scheduler.waiting]

    def _adapter_ready(self, seq: Sequence) -> bool:
        """The admission gate: a sequence runs once its adapter is device-resident (asking starts
        the load; meanwhile the sequences behind it are admitted)."""
        return seq.adapter is None or self.tiers.ready(seq.adapter.revision)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.adapters.release(seq.adapter):  # the last request on a retired revision
            assert seq.adapter is not None
            self._drained(seq.adapter)
        if not seq.params.max_tokens:
            self._num_scoring -= 1

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants: the KV pool's free/used partition, each live
        sequence's blocks covering exactly its computed tokens (plus this step's), and adapter
        holds equal to the live requests on each revision. Cheap; tests call it between steps."""
        self.pool.check_integrity()
        live = [s for s in self._seqs.values() if not s.is_finished]
        owned = [b for s in live for b in s.block_ids]
        assert len(owned) == len(set(owned)) == self.pool.num_used, "KV blocks leaked or shared"
        for seq in live:
            assert len(seq.block_ids) == self.scheduler.blocks_for(seq.num_computed), seq.request_id
        assert self._num_scoring == sum(not s.params.max_tokens for s in live), "scoring request count"
        holds: dict[AdapterRef, int] = {}
        for seq in live:
            if seq.adapter is not None:
                holds[seq.adapter] = holds.get(seq.adapter, 0) + 1
        for entry in self.adapters.list():
            assert self.adapters.holds(entry.ref) == holds.get(entry.ref, 0), f"hold count of {entry.ref}"

    # --- helpers --------------------------------------------------------------------------------

    def _static_decode(self, config: EngineConfig) -> StaticDecodeRunner | None:
        """CUDA graphs for decode steps on CUDA unless turned off (cuda_graph_max_batch = 0)."""
        max_batch = min(config.graphs.cuda_graph_max_batch, config.scheduler.max_num_seqs)
        if self.device.type != "cuda" or max_batch == 0:
            return None
        return self.static_decode_runner(max_batch, capture=True)

    def _warm_up(self, config: EngineConfig, progress: bool) -> float:
        """Seconds spent compiling every kernel variant and capturing every decode graph up front
        (CUDA, `capture_at_startup`; `engine/warmup.py`)."""
        from loraplex.engine.warmup import warm_up

        return warm_up(self, config, progress)

    def static_decode_runner(self, max_batch: int, capture: bool) -> StaticDecodeRunner:
        """A decode runner over this engine's model, KV cache and LoRA table (capture=False: the
        static buffers without CUDA graphs, as tests and benches on the CPU use them)."""
        return StaticDecodeRunner(
            self.model,
            self.kv,
            self.lora_table,
            self.lora_backend,
            self.device,
            max_batch,
            self.max_model_len,
            capture=capture,
        )

    @property
    def graph_replays(self) -> int:
        """Decode steps that ran as CUDA-graph replays (0 without graphs)."""
        sd = self.runner.static_decode
        return sd.replays if sd is not None and sd.capture else 0

    @property
    def kernel_compiles(self) -> int:
        """The project's Triton kernels compiled in this process so far (every engine's)."""
        return kernel_compiles.count()

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (one per new decode shape; a steady workload stops adding)."""
        sd = self.runner.static_decode
        return sd.captures if sd is not None else 0

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)


def _admission_batch_tokens(config: EngineConfig) -> int:
    """The configured admission batch, else half the step token budget where decode steps replay
    CUDA graphs (an eager prefill step costs several graph-replayed decode steps of host time),
    else 0."""
    sc = config.scheduler
    if sc.admission_batch_tokens is not None:
        return sc.admission_batch_tokens
    graphs = config.device.startswith("cuda") and min(config.graphs.cuda_graph_max_batch, sc.max_num_seqs) > 0
    return sc.max_num_batched_tokens // 2 if graphs else 0
