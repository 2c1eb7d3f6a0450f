"""Triton specialization keys of the project's kernels, counted without compiling anything: the
JIT's launch entry point (`JITFunction.run`) is replaced by one that binds the arguments as the
JIT does for an sm_90 device and records the key (constexprs, integer and pointer
specializations, compile options) of every launch. Used by `benchmarks/lora_specializations.py`
and by the CPU tests of the startup warm-up: a key first seen after warm-up is a compilation on
the serving path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# constexprs the launches set from the device; on CUDA (what the keys are counted for) they are these
CUDA_CONSTEXPRS = {"USE_PDL": 1, "FOR_LOOP": True, "TABLE_ASM": True}


def as_on_cuda(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A launch's keyword arguments as a CUDA device's launch passes them."""
    kwargs = dict(kwargs)
    for name, value in CUDA_CONSTEXPRS.items():
        if name in kwargs:
            kwargs[name] = value
    if "USE_PDL" in kwargs:
        kwargs["launch_pdl"] = True
    return kwargs


class KeyCounter:
    """Records (specialization, options) per kernel name while `installed`; nothing runs."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.keys: dict[str, set[tuple[Any, str]]] = defaultdict(set)
        self.launches = 0
        self._binders: dict[int, Any] = {}

    @contextmanager
    def installed(self) -> Iterator[KeyCounter]:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        original = JITFunction.run
        counter = self

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            kwargs = as_on_cuda(kwargs)
            kwargs.setdefault("debug", False)
            kwargs["instrumentation_mode"] = ""
            binder = counter._binders.get(id(fn))
            if binder is None:
                binder = create_function_from_signature(fn.signature, fn.params, counter.backend)
                counter._binders[id(fn)] = binder
            _, spec, options = binder(*args, **kwargs)
            counter.keys[fn.__name__].add((tuple(spec), str(options)))
            counter.launches += 1

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = original

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.keys.values())

    def snapshot(self) -> dict[str, frozenset[tuple[Any, str]]]:
        return {k: frozenset(v) for k, v in self.keys.items()}

    def new_since(self, before: dict[str, frozenset[tuple[Any, str]]]) -> dict[str, int]:
        """Keys per kernel not in `before` (a `snapshot`)."""
        new = {k: len(v - before.get(k, frozenset())) for k, v in self.keys.items()}
        return {k: n for k, n in new.items() if n}
