"""Counts the project's Triton kernel compilations in this process, and remembers the latest.

A compilation on the serving path stalls every request behind the step that triggered it (seconds
from an empty cache), so the engine warms every specialization it can reach up front and the
server exports this count (`loraplex_kernel_compiles_total`): after warm-up it must stay flat.

Triton calls `knobs.runtime.jit_post_compile_hook` after each new specialization of a JIT
function in this process (a miss of its in-memory cache; the on-disk cache only makes the compile
faster). The hook here counts kernels defined under `loraplex.` and passes every call on to a hook
installed before it. Installing needs triton; nothing is imported when it is absent.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any

_lock = threading.Lock()
_count = 0
_recent: deque[str] = deque(maxlen=64)  # "kernel[constexprs]" of the latest compilations
_by_kernel: Counter[str] = Counter()
_installed = False


def install() -> bool:
    """Install the counting hook once per process; False when triton is not importable."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        previous = knobs.runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> bool | None:
            fn = kwargs["fn"]
            names = getattr(fn.jit_function, "arg_names", [])
            constants = {
                names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else str(k): v
                for k, v in kwargs.get("constants", {}).items()
            }
            record(str(fn.module), fn.name, constants)
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        _installed = True
        return True


def record(module: str, name: str, constants: dict[str, Any]) -> None:
    """Count one compilation of `module.name` if it is one of the project's kernels."""
    global _count
    if not module.startswith("loraplex."):
        return
    shown = ", ".join(f"{k}={v}" for k, v in constants.items())
    with _lock:
        _count += 1
        _by_kernel[name] += 1
        _recent.append(f"{name}[{shown}]")


def count() -> int:
    return _count


def recent() -> list[str]:
    with _lock:
        return list(_recent)


def by_kernel() -> dict[str, int]:
    """Compilations per kernel name so far."""
    with _lock:
        return dict(_by_kernel)
