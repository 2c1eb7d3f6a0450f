"""Turns a step plan into tensors, runs the model once, and returns the logits rows the engine needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.adapters.residency import StepSlots
from loraplex.engine.cuda_graphs import StaticStepRunner
from loraplex.engine.pending_tokens import PendingTokens
from loraplex.engine.scheduler import StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.host_to_device import to_device
from loraplex.kv.kv_cache import PagedKVCache
from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.lora.backend import LoRABackend
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.step import LoRAContext
from loraplex.lora.weights import LoRASlotTable
from loraplex.model.llama import LlamaFamilyModel


@dataclass(frozen=True)
class PromptLogprobRow:
    chunk: int  # index into plan.chunks
    position: int  # prompt position whose token this row predicts (>= 1)


@dataclass(frozen=True)
class ForwardResult:
    sample_logits: torch.Tensor  # [n_sample, V] float32, one row per completing chunk (plan order)
    sample_chunks: tuple[int, ...]  # chunk index of each sample row
    prompt_logits: torch.Tensor  # [n_prompt, V] float32
    prompt_rows: tuple[PromptLogprobRow, ...]
    num_adapters: int  # distinct adapter slots among the step's rows
    static_replay: bool = False  # ran on static buffers (a CUDA-graph replay on CUDA)


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyModel,
        kv: PagedKVCache,
        lora_table: LoRASlotTable,
        lora_backend: LoRABackend,
        device: torch.device,
        static_steps: StaticStepRunner | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.lora_table = lora_table
        self.lora_backend = lora_backend
        self.device = device
        # steps of a captured shape go here when set (CUDA graphs on CUDA; see cuda_graphs.py)
        self.static_steps = static_steps

    @torch.inference_mode()
    def run(
        self,
        plan: StepPlan,
        slots: StepSlots,
        hidden_capture: dict[int, torch.Tensor] | None = None,
        pending: PendingTokens | None = None,
    ) -> ForwardResult:
        """One forward over the plan's rows; `slots` is the step's slot map from residency;
        `pending`: where the input ids of rows at pending positions come from."""
        static = self.static_steps
        shape = static.shape_for(plan) if static is not None and hidden_capture is None else None
        if shape is not None:
            assert static is not None
            out = static.run(plan, slots, shape, pending)
            return ForwardResult(
                sample_logits=out.logits,
                sample_chunks=out.sample_chunks,
                prompt_logits=out.logits[:0],
                prompt_rows=(),
                num_adapters=out.num_adapters,
                static_replay=True,
            )
        return self._run_eager(plan, slots, hidden_capture, pending)

    def _run_eager(
        self,
        plan: StepPlan,
        slot_map: StepSlots,
        hidden_capture: dict[int, torch.Tensor] | None,
        pending: PendingTokens | None = None,
    ) -> ForwardResult:
        bs = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lora_runs: list[tuple[int, int, int]] = []  # (adapter slot, first row, rows) per chunk
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        prompt_rows: list[int] = []
        prompt_meta: list[PromptLogprobRow] = []
        pending_rows: list[tuple[int, Sequence]] = []
        for ci, (chunk, adapter_slot) in enumerate(zip(plan.chunks, slot_map.slots, strict=True)):
            seq = chunk.seq
            start = seq.num_computed
            end = start + chunk.num_tokens
            table = seq.block_ids
            lora_runs.append((adapter_slot, len(input_ids), end - start))
            if seq.pending and end > seq.num_tokens:  # its one row is at a pending position
                pending_rows.append((len(input_ids), seq))
                input_ids.append(0)
            else:
                input_ids.extend(seq.tokens_between(start, end))
            positions.extend(range(start, end))
            # KV slots block by block: each block's positions are one contiguous run of slots
            for b in range(start // bs, -(-end // bs)):
                lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
                first = table[b] * bs + lo - b * bs
                slots.extend(range(first, first + hi - lo))
            wants_prompt_lp = seq.params.prompt_logprobs is not None
            if wants_prompt_lp:
                # Row at position p predicts prompt token p + 1; skip entries already recorded
                # (a preempted sequence recomputes its prefix).
                first = max(start, len(seq.prompt_logprobs) - 1)  # prompt_logprobs starts as [None]
                for pos in range(first, min(end, seq.prompt_len - 1)):
                    prompt_rows.append(len(input_ids) - (end - pos))
                    prompt_meta.append(PromptLogprobRow(ci, pos + 1))
            if chunk.completes:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(ci)
            query_start.append(len(input_ids))
            context_lens.append(end)

        dev = self.device
        attn = AttentionMetadata.build(
            positions,
            slots,
            query_start,
            context_lens,
            [c.seq.block_ids for c in plan.chunks],
            bs,
            dev,
        )
        lora_meta = LoRABatchMetadata.build_runs(lora_runs, len(input_ids), self.lora_table, dev)
        lora = None
        if lora_meta.num_segments:
            lora = LoRAContext.begin(lora_meta, self.lora_table, self.lora_backend)
        ids = to_device(input_ids, torch.int64, dev)
        if pending_rows:
            assert pending is not None, "a row at a pending position without the step in flight"
            pending.patch(ids, pending_rows)
        hidden = self.model(ids, attn, self.kv.k, self.kv.v, lora, hidden_capture)
        rows = to_device(sample_rows + prompt_rows, torch.int64, dev)
        logits = self.model.logits(hidden.index_select(0, rows)).float()
        n = len(sample_rows)
        return ForwardResult(
            sample_logits=logits[:n],
            sample_chunks=tuple(sample_chunks),
            prompt_logits=logits[n:],
            prompt_rows=tuple(prompt_meta),
            num_adapters=lora_meta.num_segments,
        )
