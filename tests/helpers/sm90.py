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
import subprocess
import sys
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
    **options,  # noqa: ANN003
) -> str:
    """The kernel's PTX for sm_90; arguments not in `pointers` or `constexprs` are i32. Arguments
    named in `divisible` are declared multiples of 16 (pointers: 16-byte aligned), as the JIT
    declares them when a launch's values are; without that, no load vectorizes."""
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
    return kernel.asm["ptx"]


SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def run_compile_script(module: str) -> None:
    """`python -m module` from the tests folder, with the interpreter off."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-m", module], check=True, env=env, timeout=300)
