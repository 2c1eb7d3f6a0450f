"""Compile the attention kernels for sm_90 (H100/H200) on a machine without a GPU
(`helpers/sm90.py`; `test_attention_kernels.py` runs this in a subprocess)."""

from __future__ import annotations

from helpers.sm90 import compile_sm90 as _compile

from loraplex.layers import attention_triton as at
from loraplex.layers import kv_write_triton as kw

POINTERS = {name: "*bf16" for name in ("q_ptr", "k_cache", "v_cache", "out_ptr", "k_ptr", "v_ptr")}
POINTERS.update(
    part_acc="*fp32", part_ml="*fp32", table_ptr="*i32", ctx_ptr="*i32", qstart_ptr="*i32", tiles_ptr="*i32"
)
POINTERS.update(slot_ptr="*i64")
POINTERS.update(qk_scale="fp32")


# Aligned tensors and strides, as the JIT declares them when a launch's values are: only then do
# the loads vectorize and pipeline, and shared memory reaches what the GPU will ask for.
DIVISIBLE = frozenset(
    ["q_ptr", "k_cache", "v_cache", "out_ptr", "table_ptr", "ctx_ptr", "qstart_ptr", "tiles_ptr", "stride_qt",
     "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch"]
)  # fmt: skip


def compile_sm90(fn, constexprs: dict, num_warps: int = 4, pointers: dict | None = None, **options) -> None:  # noqa: ANN001, ANN003
    """Compile (the helper also checks the shared memory against the SM's, and with
    `min_programs_per_sm` how many blocks fit an SM)."""
    _compile(fn, constexprs, pointers or POINTERS, num_warps, divisible=DIVISIBLE, **options)


def main() -> None:
    fp32 = {**POINTERS, **{name: "*fp32" for name in ("q_ptr", "k_cache", "v_cache", "out_ptr")}}
    for head_dim, group in ((128, 4), (256, 8)):
        t = at.tiling_for(head_dim)
        for pointers, prec in ((POINTERS, "tf32"), (fp32, "ieee")):
            common = dict(GROUP=group, D=head_dim, D_PAD=head_dim, BS=16, PREC=prec, FOR_LOOP=True)
            for splits in (1, 2):
                consts = dict(common, G_PAD=16, BLOCK_N=t.decode_block_n, SPLITS=splits)
                compile_sm90(at.decode_kernel, consts, t.num_warps, pointers)
            stages = t.prefill_num_stages
            for tile_map in (False, True):
                tiles = dict(BLOCK_M=t.prefill_block_m, BLOCK_N=t.prefill_block_n)
                consts = dict(common, **tiles, TILE_MAP=tile_map, STAGES=stages)
                compile_sm90(at.prefill_kernel, consts, t.num_warps, pointers)
            for splits in (1, 2):  # a mixed step's one launch: its shared memory is the larger half's
                consts = dict(
                    common, G_PAD=16, HKV=32 // group, BLOCK_M=t.prefill_block_m,
                    PREFILL_BLOCK_N=t.prefill_block_n, PREFILL_STAGES=stages, DECODE_BLOCK_N=t.decode_block_n,
                    DECODE_STAGES=at.DECODE_STAGES.value, SPLITS=splits,
                )  # fmt: skip
                cap = {"maxnreg": t.one_launch_max_registers} if t.one_launch_max_registers else {}
                # bf16 at head size 128 (the serving case): three programs an SM, as the prefill
                # kernel alone; the compiler's own register choice could halve that unseen
                fits = 3 if head_dim == 128 and prec == "tf32" else 1
                compile_sm90(
                    at.mixed_step_kernel, consts, t.num_warps, pointers, min_programs_per_sm=fits, **cap
                )
        compile_sm90(at.decode_combine_kernel, dict(HQ=32, D=head_dim, D_PAD=head_dim, SPLITS=2))
        compile_sm90(kw.kv_write_kernel, dict(HKV=8, D=head_dim, H_PAD=8, D_PAD=head_dim))
    print("compiled")


if __name__ == "__main__":
    main()
