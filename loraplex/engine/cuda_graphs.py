"""Decode steps as CUDA-graph replays, reading the live token -> adapter mapping on every replay.

A pure decode step (every sequence adds one token) of at most `GraphConfig.cuda_graph_max_batch`
sequences runs as the replay of a graph captured for its batch-size bucket. The step's inputs
(token ids, positions, KV slots, context lengths, block tables) and its LoRA metadata (row order,
segment offsets, segment slots) are written into the graph's static buffers with two host-to-device
copies, then the graph replays. Only launch shapes are baked into a graph, never the mapping:

- the batch is padded up to its bucket; a padding row is token 0 at position 0 with no KV write,
  no context and no adapter;
- the LoRA part of the inputs is the LoRA package's (`lora/graph_inputs.py`): it packs the
  step's rows into its share of the buffers and names the LoRA part of the graph key (segment
  capacity, rank tile, device-table epoch), so a graph is keyed by (bucket, that part) and
  captured on first use;
- the LoRA backend updates its device tables in place when adapters load or are replaced, so a
  replay sees the new weights behind a slot; when the tables must be reallocated (their epoch
  changes), graphs of older epochs are dropped and recaptured.

`StaticDecodeRunner(capture=False)` runs the same static-buffer path eagerly: that is how the CPU
tests check the buffers, padding and segment cutting; capture and replay need CUDA.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from loraplex.adapters.residency import StepSlots
from loraplex.engine.scheduler import StepPlan
from loraplex.kv.kv_cache import PagedKVCache
from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.lora.backend import LoRABackend
from loraplex.lora.graph_inputs import LoRAGraphInputs, LoRAGraphKey
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.step import LoRAContext
from loraplex.lora.weights import LoRASlotTable
from loraplex.model.llama import LlamaFamilyModel

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The padded batch size a graph is captured for (None: too large for graphs)."""
    if n < 1 or n > max_batch:
        return None
    for b in _BUCKETS:
        if b >= n:
            return min(b, max_batch)
    return min(-(-n // 64) * 64, max_batch)  # past the table: multiples of 64


@dataclass(frozen=True)
class GraphKey:
    batch: int
    lora: LoRAGraphKey | None  # None: no LoRA rows in the step


class _StaticInputs:
    """Device buffers of one bucket (plus pinned host twins), and the metadata views over them.

    int64 buffer: ids [B] | positions [B] | KV slots [B] | (a pad word for odd B) | the LoRA
    inputs' words; int32 buffer:
    context lens [B] | query_start [B + 1] | block table [B, W].
    """

    def __init__(
        self,
        batch: int,
        width: int,
        device: torch.device,
        vocab: int,
        lora_table: LoRASlotTable,
        lora_backend: LoRABackend,
    ) -> None:
        b = batch
        self.batch, self.width = b, width
        pin = device.type == "cuda"
        lora_at = 3 * b + (b & 1)  # an even word: the LoRA inputs' views stay 16-byte aligned
        self.host64 = torch.zeros(lora_at + LoRAGraphInputs.words(b), dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(2 * b + 1 + b * width, dtype=torch.int32, pin_memory=pin)
        self.h64 = self.host64.numpy()
        self.h32 = self.host32.numpy()
        self.h32[b : 2 * b + 1] = np.arange(b + 1)  # one query row per sequence, always
        self.table = self.h32[2 * b + 1 :].reshape(b, width)
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        d64, d32 = self.dev64, self.dev32
        self.ids = d64[:b]
        self.attn = AttentionMetadata(
            positions=d64[b : 2 * b],
            slot_mapping=d64[2 * b : 3 * b],
            query_start=tuple(range(b + 1)),
            context_lens=(0,) * b,
            kv_indices=(),
            block_tables=(),
            block_table=d32[2 * b + 1 :].view(b, width),
            context_lens_t=d32[:b],
            query_start_t=d32[b : 2 * b + 1],
            max_query_len=1,
            max_context_len=0,  # set per graph: the bound its decode launch is sized for
            num_decode_seqs=b,
            static=True,
        )
        self.lora = LoRAGraphInputs(b, self.h64[lora_at:], d64[lora_at:], lora_table, lora_backend)
        # Float32 logits [B, V], the output of every graph of this bucket. One per graph would
        # cost B * V * 4 bytes each (33 MB at B = 64 for a 128k vocabulary, 131 MB at B = 256)
        # for every LoRA segment capacity and rank tile the bucket meets, after the KV cache was
        # sized.
        self.logits = torch.empty(b, vocab, dtype=torch.float32, device=device)

    def upload(self) -> None:
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)


@dataclass
class _Captured:
    attn: AttentionMetadata
    lora_meta: LoRABatchMetadata | None
    graph: torch.cuda.CUDAGraph | None  # None: eager (capture=False)
    logits: torch.Tensor | None  # the graph's output: its bucket's static [B, V] float32 buffer


class StaticDecodeRunner:
    """Runs pure decode steps on static buffers: replays of CUDA graphs (`capture=True`, CUDA
    only) or the same forward eagerly (`capture=False`)."""

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
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.lora_table = lora_table
        self.lora_backend = lora_backend
        self.device = device
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.capture = capture
        self.width = -(-max_model_len // kv.block_size)
        self.replays = 0  # steps run on static buffers (graph replays when capturing)
        self.captures = 0
        self._inputs: dict[int, _StaticInputs] = {}
        self._graphs: dict[GraphKey, _Captured] = {}
        self._epoch: int | None = None  # the LoRA device tables' epoch of the LoRA graphs kept
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def can_run(self, plan: StepPlan) -> bool:
        if batch_bucket(len(plan.chunks), self.max_batch) is None:
            return False
        width = self.width  # a block table longer than the static one cannot be written
        return all(c.num_tokens == 1 and c.completes and len(c.seq.block_ids) <= width for c in plan.chunks)

    @torch.inference_mode()
    def run(self, plan: StepPlan, slots: StepSlots) -> tuple[torch.Tensor, int]:
        """Logits [n, V] float32 of the step's n sequences (a view of the graph's output: read it
        before the next step), and the number of distinct adapters in the step."""
        chunks = plan.chunks
        n = len(chunks)
        b = batch_bucket(n, self.max_batch)
        assert b is not None
        inputs = self._inputs_for(b)
        lora_key, distinct = inputs.lora.pack(slots.slots)
        if lora_key is not None and lora_key.epoch != self._epoch:
            # the device tables were reallocated: graphs of the older epoch read freed ones
            self._graphs = {k: g for k, g in self._graphs.items() if k.lora is None}
            self._epoch = lora_key.epoch
        key = GraphKey(b, lora_key)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._record(key, inputs)
            if captured.graph is not None and lora_key is not None:
                inputs.lora.pack(slots.slots)  # the capture recorded with an all-padding step
        self._fill(inputs, chunks, n)
        inputs.upload()
        if captured.graph is not None:
            captured.graph.replay()
            logits = captured.logits
        else:
            logits = self._forward(inputs, captured)
        self.replays += 1
        assert logits is not None
        return logits[:n], distinct

    def warm_up(self, max_rank: int, progress: bool = False) -> int:
        """Capture (or, without capture, record) every graph a decode step can need — each
        bucket, base-only and every LoRA key for adapters of rank up to `max_rank` — so no
        capture lands on the serving path while the LoRA tables keep their epoch. Returns the
        number of graphs added."""
        buckets = sorted({b for n in range(1, self.max_batch + 1) if (b := batch_bucket(n, self.max_batch))})
        keys = []
        for b in buckets:
            keys.append(GraphKey(b, None))
            keys += [GraphKey(b, lora) for lora in self._inputs_for(b).lora.keys(max_rank)]
        todo = [k for k in keys if k not in self._graphs]
        if todo and todo[-1].lora is not None:
            self._epoch = todo[-1].lora.epoch
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="capturing decode graphs", unit="graph")
        for key in todo:
            self._record(key, self._inputs_for(key.batch))
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        return len(todo)

    # --- host side ------------------------------------------------------------------------------

    def _fill(self, inputs: _StaticInputs, chunks: tuple, n: int) -> None:
        b, bs = inputs.batch, self.kv.block_size
        h64, h32, table = inputs.h64, inputs.h32, inputs.table
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            pos = seq.num_computed
            blocks = seq.block_ids
            h64[i] = seq.token_at(pos)
            h64[b + i] = pos
            h64[2 * b + i] = blocks[pos // bs] * bs + pos % bs
            h32[i] = pos + 1
            table[i, : len(blocks)] = blocks
        # padding rows: token 0 at position 0, no KV write, no context (never read: no keys)
        h64[n:b] = 0
        h64[b + n : 2 * b] = 0
        h64[2 * b + n : 3 * b] = -1
        h32[n:b] = 0

    # --- device side ----------------------------------------------------------------------------

    def _inputs_for(self, b: int) -> _StaticInputs:
        if b not in self._inputs:
            vocab = self.model.config.vocab_size
            lora = (self.lora_table, self.lora_backend)
            self._inputs[b] = _StaticInputs(b, self.width, self.device, vocab, *lora)
        return self._inputs[b]

    def _forward(self, inputs: _StaticInputs, captured: _Captured) -> torch.Tensor:
        meta = captured.lora_meta
        lora = None if meta is None else LoRAContext.begin(meta, self.lora_table, self.lora_backend)
        hidden = self.model(inputs.ids, captured.attn, self.kv.k, self.kv.v, lora)
        # the float32 conversion, into the bucket's shared output buffer
        return inputs.logits.copy_(self.model.logits(hidden))

    def _record(self, key: GraphKey, inputs: _StaticInputs) -> _Captured:
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
        self, inputs: _StaticInputs, captured: _Captured, key: GraphKey
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Record with an all-padding step (no KV writes, empty LoRA segments on the null slot), so
        # the warm-up and the capture itself change no state.
        self._fill(inputs, (), 0)
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


def warm_up_at_startup(
    static: StaticDecodeRunner | None, capture_at_startup: bool, max_rank: int, progress: bool
) -> float:
    """Seconds spent capturing every decode graph up front (CUDA, `capture_at_startup`)."""
    if static is None or not static.capture or not capture_at_startup:
        return 0.0
    t0 = time.perf_counter()
    added = static.warm_up(max_rank, progress)
    seconds = time.perf_counter() - t0
    if progress:
        print(f"captured {added} decode graphs in {seconds:.1f} s", file=sys.stderr)
    return seconds
