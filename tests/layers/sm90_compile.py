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


def compile_sm90(fn, constexprs: dict, num_warps: int = 4, **options) -> None:  # noqa: ANN001, ANN003
    _compile(fn, constexprs, POINTERS, num_warps, **options)


def main() -> None:
    for head_dim, group in ((128, 4), (256, 8)):
        t = at.tiling_for(head_dim)
        common = dict(GROUP=group, D=head_dim, D_PAD=head_dim, BS=16, PREC="tf32", FOR_LOOP=True)
        for splits in (1, 2):
            consts = dict(common, G_PAD=16, BLOCK_N=t.decode_block_n, SPLITS=splits)
            compile_sm90(at.decode_kernel, consts, t.num_warps)
        compile_sm90(at.decode_combine_kernel, dict(HQ=32, D=head_dim, D_PAD=head_dim, SPLITS=2))
        for tile_map in (False, True):
            consts = dict(common, BLOCK_M=t.prefill_block_m, BLOCK_N=t.prefill_block_n, TILE_MAP=tile_map)
            compile_sm90(at.prefill_kernel, consts, t.num_warps, num_stages=t.prefill_num_stages)
        compile_sm90(kw.kv_write_kernel, dict(HKV=8, D=head_dim, H_PAD=8, D_PAD=head_dim))
    print("compiled")


if __name__ == "__main__":
    main()
