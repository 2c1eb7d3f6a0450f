"""The compile counter: a hook on Triton's post-compile entry point counts the project's kernels
only, names their constexprs, and keeps a hook installed before it working."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex import kernel_compiles

knobs = pytest.importorskip("triton").knobs


def _info(module: str, name: str, arg_names: list[str]) -> SimpleNamespace:
    # what Triton passes as `fn` (its JitFunctionInfo: module, name, jit_function)
    return SimpleNamespace(module=module, name=name, jit_function=SimpleNamespace(arg_names=arg_names))


def test_hook_counts_project_kernels_and_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def earlier(**kwargs: object) -> None:
        seen.append(kwargs["fn"].name)  # type: ignore[attr-defined]

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", earlier)
    monkeypatch.setattr(kernel_compiles, "_installed", False)
    assert kernel_compiles.install() and kernel_compiles.install()  # once; the second is a no-op
    hook = knobs.runtime.jit_post_compile_hook
    before = kernel_compiles.count()
    hook(
        fn=_info("loraplex.lora.triton_kernels", "lora_shrink_kernel", ["x", "h", "BLOCK_R"]),
        constants={(2,): 16},
    )
    hook(fn=_info("someone.else", "their_kernel", ["y"]), constants={})
    assert kernel_compiles.count() == before + 1
    assert kernel_compiles.recent()[-1] == "lora_shrink_kernel[BLOCK_R=16]"
    per_kernel = kernel_compiles.by_kernel()
    assert per_kernel["lora_shrink_kernel"] >= 1 and "their_kernel" not in per_kernel
    assert seen == ["lora_shrink_kernel", "their_kernel"]
