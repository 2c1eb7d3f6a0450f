"""Mid-row GEMMs (64-512 rows) of the Llama-3-8B layer: a persistent Triton GEMM fed by TMA against
cuBLAS (`F.linear`), on the H200. A probe for issue 16's base-only / pure-decode ratio, not part of
the package.

Why: between 128 and 384 rows cuBLAS runs the four projections at ~1.45x the roofline's
max(weight bytes / bandwidth, FLOPs / matrix rate) (docs/bench.md, "Step token budget"). A kernel
that streams each weight tile once per step (few row tiles, column-major tile order so the row
tiles of one column tile share it through L2) and keeps enough copies in flight to hold the
memory bandwidth while the tensor cores work could run a mixed step's GEMMs in nearly the time
of their weight reads.

    python benchmarks/gemm_mid_rows.py --check-cpu            # here: the kernel's logic (interpreter)
    python benchmarks/gemm_mid_rows.py --compile-sm90         # here: every config compiles for sm_90,
                                                              # with its shared memory
    python benchmarks/gemm_mid_rows.py --out DIR              # on the GPU: the sweep (JSON + markdown)

Timing: per projection, 32 layers of distinct weights (as a step reads them: no L2 reuse across
layers), one CUDA graph of the 32 launches, replayed; microseconds per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if "--check-cpu" in sys.argv:  # before triton is imported: it reads this once
    os.environ["TRITON_INTERPRET"] = "1"

import triton
import triton.language as tl

# the four fused projections of a Llama-3-8B layer: (output features, input features)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (64, 128, 192, 256, 320, 384, 512)
LAYERS = 32


@dataclass(frozen=True)
class Config:
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    split: int = 1  # K split into this many slices, summed by a second launch
    ws: bool = False  # Triton's warp specialization of the persistent loop

    @property
    def name(self) -> str:
        ws = "-ws" if self.ws else ""
        return f"{self.bm}x{self.bn}x{self.bk}-s{self.stages}-w{self.warps}-k{self.split}{ws}"


def configs() -> list[Config]:
    tiles = [
        (64, 128, 128, 4, 4),
        (64, 256, 64, 4, 4),
        (128, 128, 64, 4, 4),
        (128, 128, 128, 3, 8),
        (128, 256, 64, 3, 8),
        (64, 128, 64, 6, 4),
    ]
    out = []
    for bm, bn, bk, stages, warps in tiles:
        # a split's float32 partial tile needs shared memory beside the stages: these two 8-warp
        # tiles then pass the H200's 227 KiB (--compile-sm90 says so)
        for split in (1,) if warps == 8 else (1, 2, 4):
            out.append(Config(bm, bn, bk, stages, warps, split))
        out.append(Config(bm, bn, bk, stages, warps, 1, ws=True))
    return out


@triton.jit
def unit(
    u, a_desc, w_desc, c_desc, p_desc, n_m, k_tiles, M_PAD,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    s = u % SPLIT
    t = u // SPLIT
    pid_m = t % n_m
    pid_n = t // n_m
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = s * k_tiles * BK
    if FOR_LOOP:
        for kk in range(k_tiles):
            a = a_desc.load([pid_m * BM, k0 + kk * BK])
            w = w_desc.load([pid_n * BN, k0 + kk * BK])
            acc = tl.dot(a, w.T, acc)
    else:  # the interpreter's range takes no tensor bounds
        kk = 0
        while kk < k_tiles:
            a = a_desc.load([pid_m * BM, k0 + kk * BK])
            w = w_desc.load([pid_n * BN, k0 + kk * BK])
            acc = tl.dot(a, w.T, acc)
            kk += 1
    if SPLIT == 1:
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))
    else:
        p_desc.store([s * M_PAD + pid_m * BM, pid_n * BN], acc)


@triton.jit
def gemm(
    a_desc, w_desc, c_desc, p_desc, M, N, K, M_PAD,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    NUM_SMS: tl.constexpr, WS: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(tl.cdiv(K, BK), SPLIT)  # per slice of K
    units = n_m * n_n * SPLIT
    # unit order: slice, then row tile, then column tile: the programs running together share
    # column tiles, so a weight tile comes from memory once and from L2 for the other rows
    if FOR_LOOP:
        for u in tl.range(tl.program_id(0), units, NUM_SMS, flatten=True, warp_specialize=WS):
            unit(u, a_desc, w_desc, c_desc, p_desc, n_m, k_tiles, M_PAD, BM, BN, BK, SPLIT, FOR_LOOP)
    else:  # the interpreter's range takes no tensor bounds
        u = tl.program_id(0)
        while u < units:
            unit(u, a_desc, w_desc, c_desc, p_desc, n_m, k_tiles, M_PAD, BM, BN, BK, SPLIT, FOR_LOOP)
            u += NUM_SMS


@triton.jit
def sum_slices(p_ptr, c_ptr, M, N, M_PAD, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + s * M_PAD * N + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


class Runner:
    """One projection at one row count under one config: descriptors and buffers built once, so
    the launches can be captured in a CUDA graph."""

    def __init__(self, cfg: Config, a, ws, c, partial, num_sms: int) -> None:  # noqa: ANN001
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.cfg = cfg
        m, k = a.shape
        n = ws[0].shape[0]
        self.m, self.n, self.k = m, n, k
        self.m_pad = -(-m // cfg.bm) * cfg.bm
        self.a_d = TensorDescriptor.from_tensor(a, [cfg.bm, cfg.bk])
        self.w_ds = [TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk]) for w in ws]
        self.c = c
        self.c_d = TensorDescriptor.from_tensor(c, [cfg.bm, cfg.bn])
        self.partial = partial
        rows = cfg.split * self.m_pad
        self.p_d = TensorDescriptor(partial, [rows, n], [n, 1], [cfg.bm, cfg.bn])
        units = -(-m // cfg.bm) * -(-n // cfg.bn) * cfg.split
        self.grid = (min(num_sms, units),)
        self.num_sms = num_sms
        self.for_loop = a.device.type == "cuda"

    def __call__(self, layer: int) -> None:
        cfg = self.cfg
        gemm[self.grid](
            self.a_d, self.w_ds[layer], self.c_d, self.p_d, self.m, self.n, self.k, self.m_pad,
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, NUM_SMS=self.num_sms, WS=cfg.ws,
            FOR_LOOP=self.for_loop,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        if cfg.split > 1:
            block = 1024
            grid = (-(-self.m * self.n // block),)
            sum_slices[grid](self.partial, self.c, self.m, self.n, self.m_pad, SPLIT=cfg.split, BLOCK=block)


def alloc_partial(torch, m: int, n: int, device: str):  # noqa: ANN001, ANN201
    # the largest any config needs: 4 slices of the row count padded to 128
    return torch.empty(4 * (-(-m // 128) * 128), n, dtype=torch.float32, device=device)


def check_cpu() -> None:
    """The kernel's logic on small shapes under the interpreter, every config's tile shape."""
    import torch

    torch.manual_seed(0)
    m, n, k = 80, 256, 512
    a = torch.randn(m, k, dtype=torch.float32)
    w = torch.randn(n, k, dtype=torch.float32)
    want = a @ w.T
    seen = set()
    for cfg in configs():
        key = (cfg.bm, cfg.bn, cfg.bk, cfg.split)
        if key in seen:
            continue
        seen.add(key)
        c = torch.empty(m, n, dtype=torch.float32)
        run = Runner(cfg, a, [w], c, alloc_partial(torch, m, n, "cpu"), num_sms=3)
        run(0)
        err = (c - want).abs().max().item() / want.abs().max().item()
        print(f"{cfg.name:28s} relative max error {err:.2e}")
        assert err < 1e-5, cfg
    print("cpu check: every config gives a @ w.T")


def compile_sm90() -> None:
    """Each config compiled for sm_90 here (no GPU): its shared memory against the H200's 227 KiB."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for cfg in configs():
        sig = {
            "a_desc": f"tensordesc<bf16[{cfg.bm}, {cfg.bk}]>",
            "w_desc": f"tensordesc<bf16[{cfg.bn}, {cfg.bk}]>",
            "c_desc": f"tensordesc<bf16[{cfg.bm}, {cfg.bn}]>",
            "p_desc": f"tensordesc<fp32[{cfg.bm}, {cfg.bn}]>",
            "M": "i32", "N": "i32", "K": "i32", "M_PAD": "i32",
        }  # fmt: skip
        consts = dict(BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, NUM_SMS=132, WS=cfg.ws, FOR_LOOP=True)
        sig.update({name: "constexpr" for name in consts})
        src = ASTSource(gemm, sig, constexprs=consts)
        t0 = time.perf_counter()
        try:
            out = triton.compile(
                src,
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=cfg.warps, num_stages=cfg.stages),
            )
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(f"{cfg.name:28s} FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        shared = out.metadata.shared
        fits = "fits" if shared <= 232448 else "TOO MUCH SHARED MEMORY"
        wgmma = "wgmma" if "wgmma" in out.asm["ptx"] else "no wgmma"
        dt = time.perf_counter() - t0
        print(f"{cfg.name:28s} shared {shared / 1024:6.1f} KiB {fits}, {wgmma}, {dt:.1f} s")


def time_graph(torch, fn, reps: int = 5) -> float:  # noqa: ANN001
    """Seconds per replay of a CUDA graph of `fn` (which launches the 32 layers)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def sweep(out_dir: Path, time_limit: float) -> None:
    import torch
    import torch.nn.functional as F

    t_start = time.perf_counter()
    dev = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(0), "num_sms": num_sms, "rows": ROWS}
    rows_out: list[dict] = []
    failed: dict[str, str] = {}
    checked: set[str] = set()
    for proj, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for m in ROWS:
            if time.perf_counter() - t_start > time_limit:
                print(f"time limit: stopping before {proj} m={m}", flush=True)
                break
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            partial = alloc_partial(torch, m, n, dev)

            def cublas(a=a, c=c, ws=ws) -> None:  # noqa: ANN001
                for w in ws:
                    torch.matmul(a, w.T, out=c)

            base = time_graph(torch, cublas) / LAYERS
            row = {"proj": proj, "m": m, "n": n, "k": k, "cublas_us": base * 1e6, "triton": {}}
            want = F.linear(a.float(), ws[0].float())
            for cfg in configs():
                if cfg.name in failed:
                    continue
                try:
                    run = Runner(cfg, a, ws, c, partial, num_sms)
                    if cfg.name + proj not in checked:  # the config's output, once per projection
                        run(0)
                        torch.cuda.synchronize()
                        err = (c.float() - want).abs().max().item() / want.abs().max().item()
                        if err > 2e-2:
                            raise AssertionError(f"relative max error {err:.3g}")
                        checked.add(cfg.name + proj)

                    def launches(run=run) -> None:  # noqa: ANN001
                        for layer in range(LAYERS):
                            run(layer)

                    t = time_graph(torch, launches) / LAYERS
                except Exception as e:  # noqa: BLE001 (a probe: record and go on)
                    failed[cfg.name] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{cfg.name}: {failed[cfg.name]}", flush=True)
                    continue
                row["triton"][cfg.name] = t * 1e6
            best = min(row["triton"].items(), key=lambda kv: kv[1], default=(None, None))
            row["best"], row["best_us"] = best
            # the roofline: the weight bytes at the measured copy rate, or the FLOPs at the matrix rate
            row["floor_us"] = max(n * k * 2 / 4.0e12, 2 * m * n * k / 790e12) * 1e6
            rows_out.append(row)
            ratio = "-" if best[1] is None else f"{best[1] / row['cublas_us']:.3f}"
            print(
                f"{proj:8s} m={m:4d} cublas {row['cublas_us']:8.1f} us  best {best[0]} "
                f"{best[1] or 0:8.1f} us  ratio {ratio}  floor {row['floor_us']:.1f}",
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    results["rows_measured"] = rows_out
    results["failed"] = failed
    results["configs"] = [asdict(c) | {"name": c.name} for c in configs()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemm_mid_rows.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "gemm_mid_rows.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = [
        f"# Mid-row GEMMs: persistent Triton TMA GEMM against cuBLAS ({results['device']})",
        "",
        "us per layer (32 layers of distinct weights, one CUDA graph); floor: max(weight bytes at "
        "4.0 TB/s, FLOPs at 790 TFLOP/s)",
        "",
        "| proj | rows | cuBLAS | best Triton | its config | Triton / cuBLAS | floor |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    stack: dict[int, list[float]] = {}
    for r in results["rows_measured"]:
        best = r["best_us"]
        ratio = "-" if best is None else f"{best / r['cublas_us']:.3f}"
        lines.append(
            f"| {r['proj']} | {r['m']} | {r['cublas_us']:.1f} | {best or 0:.1f} | {r['best']} | "
            f"{ratio} | {r['floor_us']:.1f} |"
        )
        s = stack.setdefault(r["m"], [0.0, 0.0, 0.0])
        s[0] += r["cublas_us"]
        s[1] += min(r["cublas_us"], best or r["cublas_us"])
        s[2] += r["floor_us"]
    lines += ["", "Layer stack (32 layers, the four projections), ms:", ""]
    lines += ["| rows | cuBLAS | best of the two per projection | floor |", "| ---: | ---: | ---: | ---: |"]
    for m, (cb, best, floor) in sorted(stack.items()):
        lines.append(f"| {m} | {cb * 32 / 1e3:.2f} | {best * 32 / 1e3:.2f} | {floor * 32 / 1e3:.2f} |")
    if results["failed"]:
        lines += ["", "Configs that failed:", ""]
        lines += [f"- {name}: {why}" for name, why in results["failed"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--compile-sm90", action="store_true")
    p.add_argument("--out", default="bench-results/gemm-mid-rows")
    p.add_argument("--time-limit", type=float, default=400.0, help="stop starting new row counts after this")
    args = p.parse_args()
    if args.check_cpu:
        check_cpu()
    elif args.compile_sm90:
        compile_sm90()
    else:
        sweep(Path(args.out), args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
