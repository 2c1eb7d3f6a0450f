"""What one step did, for tests, metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.kv.block_pool import BlockPool


@dataclass(frozen=True)
class StepStats:
    num_rows: int
    rows_per_request: dict[str, int]
    num_prefill_rows: int  # rows of chunks that did not reach the end of the known tokens
    num_decode_rows: int  # rows of sequences that had exactly one uncomputed token
    num_base_rows: int
    num_lora_segments: int  # distinct adapter revisions in the step
    lora_op_calls: int  # LoRA op calls that launched work (0 when the step replayed a CUDA graph)
    kv_blocks_used: int
    num_running: int
    num_waiting: int
    preempted: tuple[str, ...]
    static_replay: bool = False  # a decode step run on the static buffers (a CUDA-graph replay on CUDA)
    # tokens the sequences admitted in this step took from the prefix cache (rows not computed)
    num_cached_tokens: int = 0

    @classmethod
    def of(
        cls,
        plan: StepPlan,
        num_adapters: int,
        lora_op_calls: int,
        scheduler: Scheduler,
        pool: BlockPool,
        static_replay: bool = False,
    ) -> StepStats:
        # One pass over the chunks (a pure decode step of batch 64 is 64 of them).
        rows_per_request: dict[str, int] = {}
        rows = decode = base = 0
        for c in plan.chunks:
            n = c.num_tokens
            seq = c.seq
            rows_per_request[seq.request_id] = n
            rows += n
            if c.is_decode:
                decode += n
            if seq.adapter is None:
                base += n
        return cls(
            num_rows=rows,
            rows_per_request=rows_per_request,
            num_prefill_rows=rows - decode,
            num_decode_rows=decode,
            num_base_rows=base,
            num_lora_segments=num_adapters,
            lora_op_calls=lora_op_calls,
            kv_blocks_used=pool.num_used,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            preempted=plan.preempted,
            static_replay=static_replay,
            num_cached_tokens=plan.cached_tokens,
        )
