"""Compile Triton kernels for sm_90 (H100/H200) on a machine without a GPU.

The interpreter runs a kernel's Python and so accepts things the compiler refuses (a plain
module global read inside a kernel, say); compiling catches those in CPU CI. The compile scripts
(`layers/sm90_compile*.py`, `lora/sm90_compile_lora.py`) run with TRITON_INTERPRET unset, so the
tests start them in a subprocess (`run_compile_script`).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def can_compile_sm90() -> bool:
    """triton with its NVIDIA backend (ptxas) is installed. Looked up without importing triton:
    an import before a test module sets TRITON_INTERPRET would fix triton's mode for the run."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    return (root / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_sm90(  # noqa: ANN201
    fn,  # noqa: ANN001
    constexprs: dict,
    pointers: dict[str, str],
    num_warps: int = 4,
    divisible: frozenset[str] = frozenset(),
    min_programs_per_sm: int = 0,
    **options,  # noqa: ANN003
) -> str:
    """The kernel's PTX for sm_90; arguments not in `pointers` or `constexprs` are i32. Arguments
    named in `divisible` are declared multiples of 16 (pointers: 16-byte aligned), as the JIT
    declares them when a launch's values are; without that, no load vectorizes.
    `min_programs_per_sm`: also check that so many of its blocks fit an SM at once."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexprs left out take their defaults (the JIT does; the compiler would make them i32s)
    defaults = {
        p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty
    }
    constexprs = {**defaults, **constexprs}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in divisible}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    kernel = triton.compile(src, target=target, options=dict(num_warps=num_warps, **options))
    # A launch asking for more shared memory than an SM has fails only on the GPU (out of resources)
    shared = kernel.metadata.shared
    assert shared <= SM90_MAX_SHARED, f"{fn.__name__} {constexprs} {options}: {shared} bytes of shared memory"
    if min_programs_per_sm:
        fits = programs_per_sm(kernel.asm["cubin"], shared, num_warps)
        assert fits >= min_programs_per_sm, (
            f"{fn.__name__} {constexprs} {options}: {fits} programs an SM ({shared} bytes of shared memory)"
        )
    return kernel.asm["ptx"]


SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
SM90_SHARED_PER_SM = 233472  # bytes of shared memory an SM has for blocks (228 KiB)
SM90_REGISTERS_PER_SM = 65536


def registers_of(cubin: bytes) -> int:
    """Registers a thread of the cubin's kernel uses (`cuobjdump --dump-resource-usage`, shipped
    with triton's NVIDIA backend)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], check=True, capture_output=True, text=True
        )
    found = re.search(r"REG:(\d+)", usage.stdout)
    assert found, usage.stdout
    return int(found.group(1))


def programs_per_sm(cubin: bytes, shared: int, num_warps: int) -> int:
    """How many blocks of the kernel an sm_90 SM holds at once, by registers (allocated per warp
    in units of 256) and shared memory (plus the 1 KiB the driver reserves per block)."""
    per_warp = -(-registers_of(cubin) * 32 // 256) * 256
    by_registers = SM90_REGISTERS_PER_SM // (per_warp * num_warps)
    by_shared = SM90_SHARED_PER_SM // (shared + 1024)
    return min(by_registers, by_shared)


def run_compile_script(module: str) -> None:
    """`python -m module` from the tests folder, with the interpreter off."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-m", module], check=True, env=env, timeout=300)
