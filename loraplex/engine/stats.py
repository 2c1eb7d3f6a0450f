"""What one step did, for tests, metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.kv.block_pool import BlockPool
from loraplex.lora.metadata import BASE_SLOT, LoRABatchMetadata


@dataclass(frozen=True)
class StepStats:
    num_rows: int
    rows_per_request: dict[str, int]
    num_prefill_rows: int  # rows of chunks that did not reach the end of the known tokens
    num_decode_rows: int  # rows of sequences that had exactly one uncomputed token
    num_base_rows: int
    num_lora_segments: int  # distinct adapter revisions in the step
    lora_op_calls: int
    kv_blocks_used: int
    num_running: int
    num_waiting: int
    preempted: tuple[str, ...]

    @classmethod
    def of(
        cls,
        plan: StepPlan,
        meta: LoRABatchMetadata,
        lora_op_calls: int,
        scheduler: Scheduler,
        pool: BlockPool,
    ) -> StepStats:
        decode = sum(c.num_tokens for c in plan.chunks if c.is_decode)
        return cls(
            num_rows=plan.num_rows,
            rows_per_request={c.seq.request_id: c.num_tokens for c in plan.chunks},
            num_prefill_rows=plan.num_rows - decode,
            num_decode_rows=decode,
            num_base_rows=sum(c.num_tokens for c in plan.chunks if c.seq.slot == BASE_SLOT),
            num_lora_segments=meta.num_segments,
            lora_op_calls=lora_op_calls,
            kv_blocks_used=pool.num_used,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            preempted=plan.preempted,
        )
