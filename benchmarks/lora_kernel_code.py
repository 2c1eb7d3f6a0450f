"""The sm_90 code of every LoRA kernel launch the engine's decode and prefill paths make, dumped to a
folder, and a comparison of two such folders: for refactors that must leave the compiled kernels
alone.

    python benchmarks/lora_kernel_code.py dump /tmp/ptx-before            # here, no GPU needed (~2 min)
    python benchmarks/lora_kernel_code.py dump /tmp/ptx-gpu --device cuda  # on a GPU: the real JIT (slow:
                                                                           # > 200 s on an H200)
    python benchmarks/lora_kernel_code.py diff /tmp/ptx-before /tmp/ptx-after

`dump` runs `TritonLoRABackend` (the default per-step tilings) on Llama-3-8B layer shapes and on
the small shapes of the tests, as the engine calls it: eager steps, CUDA-graph decode steps
(static metadata) and the way `bench
kernels` times cases. Every launch is recorded; each distinct compiled kernel is written as PTX,
cubin and SASS (cuobjdump, as shipped with triton), and `index.json` lists the launches in order
with their grids and compile options.

Without a GPU (`--device cpu`) no kernel runs: each launch is compiled for sm_90 the way the JIT
compiles it (the same argument specialization: 16-byte alignment, divisibility, ones), from
tensors on the CPU. The backend then takes the CPU's choices where it looks at the device; the
recorder puts back those of a CUDA device for the shipped decode tiling (PDL on, the row loop as a
counted loop reading its table entries by inline assembly) and the SM count of an H200.

`diff` pairs the launches of two dumps in order and compares their grids, compile options, PTX
without debug information (`.loc`/`.file` lines, `$L__tmp` labels, the DWARF sections) and SASS.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT)]  # run from a checkout, installed or not

from loraplex.lora.spec_keys import as_on_cuda  # noqa: E402  (after the path above)

H200_SMS = 132

LLAMA3_8B = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
SMALL = {"qkv": (64, (64, 32, 32)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))}
GROUP_TARGETS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


# --- recording ------------------------------------------------------------------------------------


class Recorder:
    """Wraps `JITFunction.run`: every launch is recorded with the kernel it compiled to."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate
        self.label = ""
        self.launches: list[dict[str, Any]] = []
        self.kernels: dict[str, Any] = {}  # file stem -> compiled kernel
        self._stems: dict[str, str] = {}  # compiled kernel's hash -> file stem
        self._binders: dict[int, Callable[..., Any]] = {}

    @contextmanager
    def installed(self) -> Iterator[None]:
        from triton.runtime.jit import JITFunction

        original = JITFunction.run
        rec = self

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if rec.emulate:
                kwargs = as_on_cuda(kwargs)  # the device-dependent constexprs a CUDA device gets
                kernel = rec._compile_sm90(fn, args, kwargs)
            else:
                kernel = original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            rec._record(fn, args, grid, kwargs, kernel)
            return None if rec.emulate else kernel

        JITFunction.run = run  # type: ignore[method-assign]
        try:
            yield
        finally:
            JITFunction.run = original  # type: ignore[method-assign]

    def _compile_sm90(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """What `JITFunction.run` compiles for these arguments on an sm_90 device."""
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = self._binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)

    def _record(self, fn: Any, args: tuple, grid: Any, kwargs: dict[str, Any], kernel: Any) -> None:
        import torch

        if hasattr(kernel, "result"):
            kernel = kernel.result()
        stem = self._stems.get(kernel.hash)
        if stem is None:
            n = sum(1 for s in self._stems.values() if s.rsplit("-", 1)[0] == fn.__name__)
            stem = self._stems[kernel.hash] = f"{fn.__name__}-{n:02d}"
            self.kernels[stem] = kernel
        names = [p.name for p in fn.params]
        ints = {
            n: a for n, a in zip(names, args, strict=False) if isinstance(a, int) and not isinstance(a, bool)
        }
        md = kernel.metadata
        self.launches.append({
            "label": self.label,
            "kernel": fn.__name__,
            "file": stem,
            "grid": list(grid) if isinstance(grid, tuple | list) else str(grid),
            "ints": ints,
            "aligned16": [n for n, a in zip(names, args, strict=False)
                          if isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0],
            "constexprs": {k: v for k, v in kwargs.items() if k.isupper()},
            "options": {"num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared,
                        "launch_pdl": md.launch_pdl, "maxnreg": md.maxnreg},
        })  # fmt: skip


def _cuobjdump() -> str | None:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def write_dump(rec: Recorder, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tool = _cuobjdump()
    for stem, kernel in rec.kernels.items():
        asm = kernel.asm
        (out / f"{stem}.ptx").write_text(asm["ptx"])
        (out / f"{stem}.ttgir").write_text(asm["ttgir"])
        cubin = out / f"{stem}.cubin"
        cubin.write_bytes(asm["cubin"])
        if tool is not None:
            sass = subprocess.run([tool, "-sass", "-res-usage", str(cubin)], capture_output=True, text=True)
            (out / f"{stem}.sass").write_text(sass.stdout + sass.stderr)
    (out / "index.json").write_text(json.dumps({"launches": rec.launches}, indent=1) + "\n")


# --- the engine's calls ---------------------------------------------------------------------------


def _table(shapes: dict, ranks: list[int], device: Any, targets: tuple[str, ...] | None = None) -> Any:
    import torch

    from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

    gen = torch.Generator().manual_seed(0)
    table = LoRASlotTable(1)
    for slot, r in enumerate(ranks):
        pairs = {}
        for group, (d_in, widths) in shapes.items():
            for t, d_out in zip(GROUP_TARGETS[group], widths, strict=True):
                if targets is None or t in targets:
                    a = torch.randn(r, d_in, generator=gen).to(device, torch.bfloat16)
                    b = torch.randn(d_out, r, generator=gen).to(device, torch.bfloat16)
                    pairs[(0, t)] = LoRAPair(a, b, 2.0)
        table.set(slot, AdapterWeights(pairs))
    return table


def _static_meta(row_slots: list[int], table: Any, backend: Any, device: Any) -> Any:
    """A CUDA-graph decode step's metadata, laid out in the static buffers as the engine's graph
    runner lays it out (`lora/graph_inputs.py`: segments cut to SEGMENT_ROWS rows, padded up to a
    power of two on the null slot)."""
    import torch

    from loraplex.engine.cuda_graphs import batch_bucket
    from loraplex.lora.graph_inputs import LoRAGraphInputs

    b = batch_bucket(len(row_slots), 256)
    assert b is not None
    host = torch.zeros(LoRAGraphInputs.words(b), dtype=torch.int64)
    words = host.to(device)
    inputs = LoRAGraphInputs(b, host.numpy(), words, table, backend)
    key, _ = inputs.pack(row_slots)
    assert key is not None
    words.copy_(host)  # the runner's upload
    return inputs.metadata(key)


def _spread(rows: int, adapters: int) -> list[int]:
    """Decode rows of `adapters` adapters, interleaved (a segment per adapter after grouping)."""
    return [i % adapters for i in range(rows)]


def run_cases(rec: Recorder, device: Any) -> None:
    import torch

    from loraplex.lora.metadata import LoRABatchMetadata
    from loraplex.lora.ops_triton import TritonLoRABackend
    from loraplex.lora.step import LoRAContext

    if device.type != "cuda":
        TritonLoRABackend._num_sms = lambda self, device: H200_SMS  # type: ignore[method-assign]

    def offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
        out = [0]
        for w in widths:
            out.append(out[-1] + w)
        return tuple(out)

    def calls(name: str, shapes: dict, table: Any, row_slots: list[int], how: str) -> None:
        """One forward's LoRA calls. how: 'eager' (an eager engine step), 'bench' (`bench kernels`:
        eager metadata, begun as a graph replay), 'graph' (a captured decode step)."""
        be = TritonLoRABackend()
        if how == "graph":
            meta = _static_meta(row_slots, table, be, device)
            rows = meta.num_rows
        else:
            meta = LoRABatchMetadata.build(row_slots, table, device)
            rows = len(row_slots)
        if how == "bench":
            be.prepare(meta, table, device)
            be.begin_step(meta, table, device, replayed=True)
        else:
            LoRAContext.begin(meta, table, be)
        for group, (d_in, widths) in shapes.items():
            x = torch.zeros(rows, d_in, dtype=torch.bfloat16, device=device)
            y = torch.zeros(rows, sum(widths), dtype=torch.bfloat16, device=device)
            args = (meta, table, 0, group, offsets(widths))
            rec.label = f"{name} | {how} | {group}"
            be.apply(y, x, *args)

    def case(name: str, shapes: dict, ranks: list[int], row_slots: list[int], hows: tuple[str, ...],
             targets: tuple[str, ...] | None = None) -> None:  # fmt: skip
        print(f"{name}: {', '.join(hows)}", flush=True)
        table = _table(shapes, ranks, device, targets)
        for how in hows:
            calls(name, shapes, table, row_slots, how)

    every = ("eager", "bench", "graph")
    case("llama decode M=64 D=32 r=16", LLAMA3_8B, [16] * 32, _spread(64, 32), every)
    case("llama decode M=64 D=32 r=mixed", LLAMA3_8B, [8, 16, 32, 64] * 8, _spread(64, 32), every)
    case("llama decode M=1 D=1 r=16", LLAMA3_8B, [16], [0], every)
    case("llama decode M=256 D=8 r=16", LLAMA3_8B, [16] * 8, _spread(256, 8), every)
    case("llama decode M=16 D=4 r=128", LLAMA3_8B, [128] * 4, _spread(16, 4), ("eager", "graph"))
    case("llama decode M=64 D=8 r=12", LLAMA3_8B, [12] * 8, _spread(64, 8), ("eager", "graph"))
    # more segments than the decode grid budget: the two-launch path with the decode tiling
    case("llama decode M=300 D=300 r=8 o", LLAMA3_8B, [8] * 300, list(range(300)), ("eager",), ("o",))
    case(
        "llama prefill M=4096 D=8 r=16",
        LLAMA3_8B,
        [16] * 8,
        [i // 512 for i in range(4096)],
        ("eager", "bench"),
    )
    mixed_rows = [0] * 100 + list(range(1, 9))  # a prefill chunk beside decode rows
    case("llama mixed M=108 D=9 r=16", LLAMA3_8B, [16] * 9, mixed_rows, ("eager",))
    case("small decode M=8 D=4 r=8,16", SMALL, [8, 16, 8, 16], _spread(8, 4), every)
    case("small prefill M=128 D=2 r=16", SMALL, [16, 16], [i // 64 for i in range(128)], ("eager",))


def dump(out: Path, device_name: str) -> None:
    if device_name == "cpu":
        os.environ.pop("TRITON_INTERPRET", None)  # compiled for sm_90, never interpreted
    import torch

    device = torch.device(device_name)
    if out.exists():
        shutil.rmtree(out)
    rec = Recorder(emulate=device.type != "cuda")
    with rec.installed(), torch.inference_mode():
        run_cases(rec, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    write_dump(rec, out)
    print(f"{len(rec.launches)} launches, {len(rec.kernels)} compiled kernels -> {out}")


# --- comparing two dumps --------------------------------------------------------------------------

_DEBUG_LINE = re.compile(r"^\s*(\.loc|\.file)\b|^\$L__tmp\d+:$")


def ptx_code(text: str) -> list[str]:
    """PTX without debug information: no DWARF sections, `.loc`/`.file` lines, `$L__tmp` labels
    or comments."""
    cut = text.find("\t.section\t.debug")
    if cut >= 0:
        text = text[:cut]
    lines = []
    for line in text.splitlines():
        if _DEBUG_LINE.search(line):
            continue
        line = line.split("//", 1)[0].rstrip()
        if line:
            lines.append(line)
    return lines


def sass_code(text: str) -> list[str]:
    return [
        ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("Fatbin", "="))
    ]


def _read(folder: Path, stem: str, ext: str) -> str:
    p = folder / f"{stem}.{ext}"
    return p.read_text() if p.exists() else ""


def diff(before: Path, after: Path) -> int:
    a = json.loads((before / "index.json").read_text())["launches"]
    b = json.loads((after / "index.json").read_text())["launches"]
    if [(x["label"], x["kernel"]) for x in a] != [(x["label"], x["kernel"]) for x in b]:
        print(f"the launches differ: {len(a)} before, {len(b)} after")
        for line in difflib.unified_diff(
            [f"{x['label']} {x['kernel']}" for x in a],
            [f"{x['label']} {x['kernel']}" for x in b],
            lineterm="",
        ):
            print(line)
        return 1
    pairs: dict[tuple[str, str], list[dict]] = {}
    bad = 0
    for x, y in zip(a, b, strict=True):
        if (x["grid"], x["ints"], x["options"]) != (y["grid"], y["ints"], y["options"]):
            print(
                f"{x['label']} {x['kernel']}: launch differs:",
                x["grid"],
                x["options"],
                y["grid"],
                y["options"],
            )
            bad += 1
        pairs.setdefault((x["file"], y["file"]), []).append(x)
    for (fa, fb), launches in sorted(pairs.items()):
        pa, pb = _read(before, fa, "ptx"), _read(after, fb, "ptx")
        sa, sb = _read(before, fa, "sass"), _read(after, fb, "sass")
        same_sass = sass_code(sa) == sass_code(sb)
        if pa == pb and same_sass:
            verdict = "identical"
        elif ptx_code(pa) == ptx_code(pb) and same_sass:
            verdict = "identical except debug info"
        else:
            verdict = "DIFFERENT"
            bad += 1
        print(f"{fa} -> {fb}: {verdict} ({len(launches)} launches, e.g. {launches[0]['label']})")
        if verdict == "DIFFERENT":
            for line in list(difflib.unified_diff(ptx_code(pa), ptx_code(pb), fa, fb, lineterm=""))[:80]:
                print("   ", line)
    verdict = f"{bad} differ" if bad else "all the same code"
    print(f"{len(a)} launches, {len(pairs)} distinct kernel pairs: {verdict}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="compile every launch of the shipped paths and write the code")
    d.add_argument("out", type=Path)
    d.add_argument("--device", default="cpu", help="cpu (compiled for sm_90 here) or cuda (the JIT's own)")
    c = sub.add_parser("diff", help="compare two dumps launch by launch")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.device)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
