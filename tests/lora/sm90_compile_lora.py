"""Compile the LoRA kernels (`lora/triton_kernels.py`) for sm_90 on a machine without a GPU
(`helpers/sm90.py`; `test_lora_compile.py` runs this in a subprocess): the split launch's kernels
with and without PDL (and per-step segment tables), and the two-launch shrink/expand pair at the
decode and the prefill tiling, for 3 slices at rank tile 16; and the decode launches with
float32 operands, which must multiply in IEEE float32, not TF32. (`benchmarks/lora_kernel_code.py`
dumps the code of every launch the engine's paths make.)

    python -m lora.sm90_compile_lora [DIR]   # from tests/; DIR: also write each kernel's PTX there
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers.sm90 import compile_sm90

from loraplex.lora import triton_kernels as tk

POINTERS = {name: "*bf16" for name in ("x_ptr", "y_ptr", "w_base")}
POINTERS.update(h_ptr="*fp32", scale_tab="*fp32", rank_tab="*i32", row_seg_ptr="*i32")
POINTERS.update(
    {name: "*i64" for name in ("row_perm_ptr", "seg_offsets_ptr", "seg_slots_ptr", "a_tab", "b_tab")}
)

COMMON = dict(N_SLICES=3, W_ALIGN=8, BLOCK_R=16)
SHRINK = dict(BLOCK_K=128, BLOCK_RC=16)
EXPAND = dict(COLS_ALIGNED=True, BLOCK_N=256)


def kernels() -> dict[str, tuple]:
    """name -> (kernel, constexprs, num_warps, num_stages)"""
    out: dict[str, tuple] = {}
    for pdl in (0, 1):
        out[f"shrink_pdl{pdl}"] = (
            tk.lora_shrink_pdl_kernel,
            dict(COMMON, **SHRINK, BLOCK_M=16, USE_PDL=pdl, SEG_TABLES=bool(pdl), FOR_LOOP=True),
            2,
            3,
        )
        consts = dict(COMMON, **EXPAND, BLOCK_M=16, N_SPLIT=16, USE_PDL=pdl, SEG_TABLES=bool(pdl))
        out[f"expand_pdl{pdl}"] = (tk.lora_expand_pdl_kernel, consts, 4, 4)
        # row tiles spanning segments, a pipelined loop over their segments, table entries by
        # inline-assembly loads (B the loop's only pipelined load), as on CUDA
        consts = dict(COMMON, COLS_ALIGNED=True, BLOCK_M=16, BLOCK_N=128, N_SPLIT=16, USE_PDL=pdl)
        out[f"expand_rows_pdl{pdl}_table_asm"] = (
            tk.lora_expand_rows_kernel,
            dict(consts, SEG_TABLES=bool(pdl), FOR_LOOP=True, TABLE_ASM=True),
            4,
            4,
        )
    for name, block_m, block_k, split in (("decode", 16, 128, 16), ("prefill", 64, 64, 4)):
        consts = dict(COMMON, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_RC=16, FOR_LOOP=True)
        out[f"shrink_{name}"] = (tk.lora_shrink_kernel, consts, 4, 3)
        consts = dict(COMMON, COLS_ALIGNED=True, BLOCK_M=block_m, BLOCK_N=128, N_SPLIT=split)
        out[f"expand_{name}"] = (tk.lora_expand_kernel, dict(consts, N_CHUNK=512), 4, 3)
    return out


# what a launch declares aligned (torch's allocations, and the Llama-3 shapes' strides and sizes)
DIVISIBLE = frozenset(POINTERS) | {"stride_xm", "stride_ym", "d_in", "num_rows", "k_chunk"}


def check_vector_loads(name: str, ptx: str) -> None:
    """The split launch's kernels read weights and activations in 16-byte vectors (plain or as
    the pipeline's async copies into shared memory); a scalar bf16 load means an address lost the
    alignment the launch declares, and the kernel then moves its bytes 2 at a time."""
    vectors = "ld.global.v4" in ptx or re.search(r"cp\.async\.cg\.shared\.global[^;]*0x10", ptx)
    if "ld.global.b16" in ptx or not vectors:
        raise SystemExit(f"{name}: weight or activation loads are not 16-byte vectors")


def check_b_tiles_in_flight(name: str, ptx: str) -> None:
    """With its table entries read by inline assembly, the row-loop expand's pipelined loop must
    leave B copies in flight when it waits (`cp.async.wait_group N`, N > 0); waits for 0 only
    mean each step drains the copies issued ahead, one B tile at a time."""
    if not any(int(n) > 0 for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)):
        raise SystemExit(f"{name}: the row loop waits for every copy in flight; no B tile stays ahead")


def check_no_tf32(name: str, ptx: str) -> None:
    """A float32 engine's LoRA products are IEEE float32, as its base GEMMs are (TF32 off): Triton's
    default for float32 dot operands is TF32, which keeps 10 mantissa bits of each."""
    if "tf32" in ptx:
        raise SystemExit(f"{name}: float32 operands multiplied as TF32")


def main() -> None:
    dump = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    fp32 = {**POINTERS, **{name: "*fp32" for name in ("x_ptr", "y_ptr", "w_base")}}
    for name, (fn, consts, warps, stages) in kernels().items():
        ptx = compile_sm90(fn, consts, POINTERS, warps, divisible=DIVISIBLE, num_stages=stages)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{name}.ptx").write_text(ptx)
        if name.startswith(("shrink_pdl", "expand_pdl", "expand_rows_pdl")):
            check_vector_loads(name, ptx)
        if name.startswith("expand_rows_pdl") and name.endswith("_table_asm"):
            check_b_tiles_in_flight(name, ptx)
        if name.endswith(("pdl1", "decode", "pdl1_table_asm")):  # the float32 engine's launches
            consts = dict(consts, W_ALIGN=4)  # elements per 16 bytes
            check_no_tf32(f"{name} (float32)", compile_sm90(fn, consts, fp32, warps, divisible=DIVISIBLE))
    print("compiled")


if __name__ == "__main__":
    main()
