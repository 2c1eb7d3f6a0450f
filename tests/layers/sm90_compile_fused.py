"""Compile the fused elementwise kernels (`fused_triton.py`) for sm_90 on a machine without a GPU
(`helpers/sm90.py`; `test_fused_ops.py` runs this in a subprocess). Llama-3-8B shapes in bf16,
plus Qwen3's fused q/k norm and a padded head_dim.
"""

from __future__ import annotations

from helpers.sm90 import compile_sm90 as _compile

from loraplex.layers import fused_triton as ft

POINTERS = {
    name: "*bf16"
    for name in ("x_ptr", "d_ptr", "res_ptr", "w_ptr", "out_ptr", "q_ptr", "k_ptr", "qw_ptr", "kw_ptr")
}
POINTERS.update(pos_ptr="*i64", cache_ptr="*fp32", eps="fp32", eps_q="fp32", eps_k="fp32")


def compile_sm90(fn, constexprs: dict, num_warps: int = 4, **options) -> str:  # noqa: ANN001, ANN003
    """Returns the PTX."""
    return _compile(fn, constexprs, POINTERS, num_warps, **options)


def main() -> None:
    for has_res in (False, True):
        compile_sm90(ft._rmsnorm_kernel, dict(D=4096, BLOCK=4096, HAS_RES=has_res), num_warps=8)
    for norm in (False, True):
        rope = dict(HQ=32, HKV=8, HALF=64, HQ_PAD=32, HKV_PAD=8, HALF_PAD=64, NORM=norm)
        ptx = compile_sm90(ft._rotary_kernel, rope, num_warps=8, enable_fp_fusion=False)
        # RoPE must round each product like torch does: no fused multiply-adds
        assert "fma." not in ptx, "RoPE kernel compiled with FMAs"
    rope = dict(HQ=8, HKV=1, HALF=12, HQ_PAD=8, HKV_PAD=1, HALF_PAD=16, NORM=False)
    compile_sm90(ft._rotary_kernel, rope, enable_fp_fusion=False)
    for has_delta in (False, True):
        compile_sm90(ft._silu_mul_kernel, dict(BLOCK=1024, HAS_DELTA=has_delta))
    print("compiled")


if __name__ == "__main__":
    main()
