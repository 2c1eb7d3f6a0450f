"""Decode and mixed steps as CUDA-graph replays, reading the live token -> adapter mapping on every
replay.

A pure decode step (every sequence adds one token) of at most `max_batch` sequences replays the
graph of its batch-size bucket; a step with prefill chunks (beside decode rows or not) of at most
`max_tokens` rows and `max_batch` sequences replays the graph of its token bucket (the shapes and
buffers: `static_inputs.py`). The step's inputs and its LoRA metadata (row order, segment offsets,
segment slots) are written into the graph's static buffers with two host-to-device copies, then
the graph replays. Only launch shapes are baked into a graph, never the mapping:

- the step is padded up to its shape (`static_inputs.py`);
- the LoRA part of the inputs is the LoRA package's (`lora/graph_inputs.py`): it packs the
  step's rows into its share of the buffers and names the LoRA part of the graph key (segment
  capacity, rank tile, device-table epoch), so a graph is keyed by (shape, that part) and
  captured at startup (`warm_up`) or on first use;
- the LoRA backend updates its device tables in place when adapters load or are replaced, so a
  replay sees the new weights behind a slot; when the tables must be reallocated (their epoch
  changes), graphs of older epochs are dropped and recaptured.

Steps the graphs do not take run eagerly: prompt logprobs (every prompt row's logits), captured
hidden states, more rows or sequences than the graphs hold, block tables past `max_model_len`.
`StaticStepRunner(capture=False)` runs the same static-buffer path eagerly: that is how the CPU
tests check the buffers, padding and segment cutting; capture and replay need CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loraplex.adapters.residency import StepSlots
from loraplex.config import EngineConfig
from loraplex.engine.pending_tokens import PendingTokens
from loraplex.engine.scheduler import StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.engine.static_inputs import StaticInputs, StepShape, batch_bucket, token_bucket, token_buckets
from loraplex.kv.kv_cache import PagedKVCache
from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.lora.backend import LoRABackend
from loraplex.lora.graph_inputs import LoRAGraphKey
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.step import LoRAContext
from loraplex.lora.weights import LoRASlotTable
from loraplex.model.llama import LlamaFamilyModel

__all__ = ["GraphKey", "StaticStepRunner", "StepShape", "batch_bucket", "token_bucket"]


def graph_limits(config: EngineConfig) -> tuple[int, int]:
    """(most sequences of a step that replays a graph, most rows of a step with prefill chunks
    that does); 0 sequences: no graphs, 0 rows: decode steps only."""
    g, sc = config.graphs, config.scheduler
    budget = sc.step_token_budget
    max_tokens = budget if g.cuda_graph_max_tokens is None else min(g.cuda_graph_max_tokens, budget)
    return min(g.cuda_graph_max_batch, sc.max_num_seqs), max_tokens


@dataclass(frozen=True)
class GraphKey:
    shape: StepShape
    lora: LoRAGraphKey | None  # None: no LoRA rows in the step


@dataclass
class _Captured:
    attn: AttentionMetadata
    lora_meta: LoRABatchMetadata | None
    graph: torch.cuda.CUDAGraph | None  # None: eager (capture=False)
    logits: torch.Tensor | None  # the graph's output: a view of the shared [S, V] float32 buffer


@dataclass(frozen=True)
class StaticRun:
    logits: torch.Tensor  # [n_sample, V] float32, a view of the graph's output: read it before the next step
    sample_chunks: tuple[int, ...]  # the chunk of each logits row
    num_adapters: int  # distinct adapter slots among the step's rows


class StaticStepRunner:
    """Runs decode and mixed steps on static buffers: replays of CUDA graphs (`capture=True`,
    CUDA only) or the same forward eagerly (`capture=False`). `max_tokens` 0: decode steps only."""

    def __init__(
        self,
        model: LlamaFamilyModel,
        kv: PagedKVCache,
        lora_table: LoRASlotTable,
        lora_backend: LoRABackend,
        device: torch.device,
        max_batch: int,
        max_model_len: int,
        capture: bool,
        max_tokens: int = 0,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.lora_table = lora_table
        self.lora_backend = lora_backend
        self.device = device
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.capture = capture
        self.width = -(-max_model_len // kv.block_size)
        self.replays = 0  # steps run on static buffers (graph replays when capturing)
        self.mixed_replays = 0  # of which mixed steps
        self.captures = 0
        self._inputs: dict[StepShape, StaticInputs] = {}
        self._graphs: dict[GraphKey, _Captured] = {}
        # float32 logits [S, V] per sequence count, shared by every graph of that many sequences
        self._logits: dict[int, torch.Tensor] = {}
        self._epoch: int | None = None  # the LoRA device tables' epoch of the LoRA graphs kept
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._tile_rows = self._prefill_tile_rows()

    def shape_for(self, plan: StepPlan) -> StepShape | None:
        """The captured shape that runs this step, or None (eager)."""
        chunks = plan.chunks
        width = self.width  # a block table longer than the static one cannot be written
        for c in chunks:
            if len(c.seq.block_ids) > width:
                return None
        # (the scheduler's flag saves a pass over the chunks on every steady decode step)
        if plan.pure_decode or all(c.num_tokens == 1 and c.completes for c in chunks):
            b = batch_bucket(len(chunks), self.max_batch)
            if b is not None:
                return StepShape.decode(b)
        rows = token_bucket(plan.num_rows, self.max_tokens) if self.max_tokens else None
        if rows is None:
            return None
        shape = StepShape.mixed_for(rows, self.max_batch)
        if len(chunks) > shape.seqs or any(_scores_prompt(c.seq) for c in chunks):
            return None  # prompt logprobs read every prompt row's logits: eager
        return shape

    @torch.inference_mode()
    def run(
        self,
        plan: StepPlan,
        slots: StepSlots,
        shape: StepShape | None = None,
        pending: PendingTokens | None = None,
    ) -> StaticRun:
        """The step on the static buffers of `shape` (by default `shape_for(plan)`, which must
        not be None); `pending`: the step in flight's tokens, for rows at pending positions."""
        shape = shape or self.shape_for(plan)
        assert shape is not None, "a step the graphs do not take"
        chunks = plan.chunks
        inputs = self._inputs_for(shape)
        lora_key, distinct, pending_rows = self._fill(inputs, chunks, slots)
        if lora_key is not None and lora_key.epoch != self._epoch:
            # the device tables were reallocated: graphs of the older epoch read freed ones
            self._graphs = {k: g for k, g in self._graphs.items() if k.lora is None}
            self._epoch = lora_key.epoch
        key = GraphKey(shape, lora_key)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._record(key, inputs)
            if captured.graph is not None:  # the capture recorded an all-padding step: write ours again
                self._fill(inputs, chunks, slots)
        inputs.upload()
        if pending_rows:
            assert pending is not None, "a row at a pending position without the step in flight"
            pending.patch(inputs.ids, pending_rows)
        if captured.graph is not None:
            captured.graph.replay()
            logits = captured.logits
        else:
            logits = self._forward(inputs, captured)
        self.replays += 1
        self.mixed_replays += shape.mixed
        assert logits is not None
        if shape.mixed:
            sample_chunks = tuple(i for i, c in enumerate(chunks) if c.completes)
        else:
            sample_chunks = tuple(range(len(chunks)))
        return StaticRun(logits[: len(sample_chunks)], sample_chunks, distinct)

    def _fill(
        self, inputs: StaticInputs, chunks: tuple, slots: StepSlots
    ) -> tuple[LoRAGraphKey | None, int, list[tuple[int, Sequence]]]:
        """Write the step into the host buffers: (the LoRA key, distinct adapters, pending rows)."""
        bs = self.kv.block_size
        if inputs.shape.mixed:
            runs, pending_rows = inputs.fill_mixed(chunks, slots.slots, bs)
            lora_key, distinct = inputs.lora.pack_runs(runs)
        else:
            pending_rows = inputs.fill_decode(chunks, bs)
            lora_key, distinct = inputs.lora.pack(slots.slots)
        return lora_key, distinct, pending_rows

    def shapes(self) -> list[StepShape]:
        """Every shape a step can take: the decode buckets, then the token buckets."""
        decode = {b for n in range(1, self.max_batch + 1) if (b := batch_bucket(n, self.max_batch))}
        shapes = [StepShape.decode(b) for b in sorted(decode)]
        if self.max_tokens:
            shapes += [StepShape.mixed_for(r, self.max_batch) for r in token_buckets(self.max_tokens)]
        return shapes

    @torch.inference_mode()
    def warm_up(self, max_rank: int, progress: bool = False) -> int:
        """Capture (or, without capture, record) every graph a step can need — each shape,
        base-only and every LoRA key for adapters of rank up to `max_rank` — so no capture lands
        on the serving path while the LoRA tables keep their epoch. Returns the number of graphs
        added."""
        keys = []
        for shape in self.shapes():
            keys.append(GraphKey(shape, None))
            keys += [GraphKey(shape, lora) for lora in self._inputs_for(shape).lora.keys(max_rank)]
        todo = [k for k in keys if k not in self._graphs]
        if todo and todo[-1].lora is not None:
            self._epoch = todo[-1].lora.epoch
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="capturing CUDA graphs", unit="graph")
        for key in todo:
            self._record(key, self._inputs_for(key.shape))
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        return len(todo)

    # --- device side ----------------------------------------------------------------------------

    def _prefill_tile_rows(self) -> int:
        """Rows per tile of the prefill launch the mixed graphs' tile maps are cut for (the torch
        reference reads no tile map)."""
        from loraplex.layers.attention_tiling import tiling_for

        return tiling_for(self.model.config.head_dim).prefill_block_m

    def _inputs_for(self, shape: StepShape) -> StaticInputs:
        if shape not in self._inputs:
            lora = (self.lora_table, self.lora_backend)
            self._inputs[shape] = StaticInputs(shape, self.width, self.device, *lora, self._tile_rows)
        return self._inputs[shape]

    def _logits_for(self, seqs: int) -> torch.Tensor:
        # One output per graph would cost S * V * 4 bytes each (33 MB at S = 64 for a 128k
        # vocabulary) for every LoRA shape a bucket meets, after the KV cache was sized.
        if seqs not in self._logits:
            vocab = self.model.config.vocab_size
            self._logits[seqs] = torch.empty(seqs, vocab, dtype=torch.float32, device=self.device)
        return self._logits[seqs]

    def _forward(self, inputs: StaticInputs, captured: _Captured) -> torch.Tensor:
        meta = captured.lora_meta
        lora = None if meta is None else LoRAContext.begin(meta, self.lora_table, self.lora_backend)
        hidden = self.model(inputs.ids, captured.attn, self.kv.k, self.kv.v, lora)
        if inputs.sample_rows is not None:
            hidden = hidden.index_select(0, inputs.sample_rows)
        # the float32 conversion, into the shared output buffer
        return self._logits_for(inputs.shape.seqs).copy_(self.model.logits(hidden))

    def _record(self, key: GraphKey, inputs: StaticInputs) -> _Captured:
        # the decode launch is sized for the longest context any replay may have
        attn = replace(inputs.attn, max_context_len=self.max_model_len)
        meta = None if key.lora is None else inputs.lora.metadata(key.lora)
        captured = _Captured(attn, meta, None, None)
        if self.capture:
            captured.graph, captured.logits = self._capture(inputs, captured, key)
            self.captures += 1
        self._graphs[key] = captured
        return captured

    def _capture(
        self, inputs: StaticInputs, captured: _Captured, key: GraphKey
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Record with an all-padding step (no KV writes, empty LoRA segments on the null slot), so
        # the warm-up and the capture itself change no state.
        inputs.fill_empty()
        if key.lora is not None:
            inputs.lora.pack_empty(key.lora)
        inputs.upload()
        # Warm up outside the capture (kernel compilation, split-launch plans, lazy buffers).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(inputs, captured)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(inputs, captured)
        return graph, logits


def _scores_prompt(seq: Sequence) -> bool:
    """Whether this step's rows of `seq` include prompt rows whose logprobs it asked for."""
    return seq.params.prompt_logprobs is not None and seq.num_computed < seq.prompt_len - 1
