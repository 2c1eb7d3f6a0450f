"""CUTLASS sm90 GEMM configurations (built by build.sh, loaded with ctypes) against F.linear (cuBLAS)
on the Llama-3-8B projections: 32 layers of distinct weights per CUDA graph, rows 64..512, each
configuration's output checked against F.linear first. Prints a table per projection and row count
and the 32-layer stack with the faster of the two per projection. Results under $OUT."""

import ctypes
import glob
import json
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = torch.device("cuda")
PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [int(r) for r in os.environ.get("ROWS", "64,128,192,256,320,384,512").split(",")]
LAYERS = 32
KEYS = ("proj", "rows", "cublas")
here = os.path.dirname(os.path.abspath(__file__))
libs = {}
for path in sorted(glob.glob(os.path.join(here, "lib", "*.so"))):
    lib = ctypes.CDLL(path)
    lib.lp_gemm.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_void_p]
    lib.lp_gemm.restype = ctypes.c_int
    libs[os.path.basename(path)[:-3]] = lib
with open(os.path.join(here, "configs.txt")) as f:
    cfgs = {line.split()[0]: line.split()[1:] for line in f if line.strip()}
ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
stream = torch.cuda.Stream()


def timed(fn, reps: int = 20) -> float:
    """Median µs a layer of `fn` (all 32 layers) replayed as one CUDA graph."""
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / LAYERS)
    ts.sort()
    return ts[len(ts) // 2]


def best_cutlass(row: dict) -> float:
    return min(v for c, v in row.items() if c not in KEYS and v)


def measure(proj: str, n: int, k: int, m: int, weights: list[torch.Tensor]) -> dict:
    """One projection at m rows: cuBLAS and every configuration, µs a layer (None: failed or wrong)."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ref = F.linear(x, weights[0]).float()
    row: dict = {"proj": proj, "rows": m}

    def cublas() -> None:
        for i in range(LAYERS):
            torch.mm(x, weights[i].t(), out=outs[i])

    row["cublas"] = timed(cublas)
    for name, lib in libs.items():

        def run(lib=lib, name=name) -> None:
            s = torch.cuda.current_stream().cuda_stream
            for i in range(LAYERS):
                ptrs = (x.data_ptr(), weights[i].data_ptr(), outs[i].data_ptr(), ws.data_ptr())
                rc = lib.lp_gemm(m, n, k, *ptrs, ws.numel(), s)
                if rc:
                    raise RuntimeError(f"{name} rc {rc}")

        try:
            with torch.cuda.stream(stream):
                run()
            torch.cuda.synchronize()
            err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                row[name] = None
                print(f"{proj} {m} {name}: wrong, rel err {err:.3g}", flush=True)
                continue
            row[name] = timed(run)
        except Exception as e:  # noqa: BLE001
            row[name] = None
            print(f"{proj} {m} {name}: {e}", flush=True)
    best = best_cutlass(row)
    print(f"{proj:8s} {m:4d} cublas {row['cublas']:7.1f}  best {best:7.1f}  ({best / row['cublas']:.3f})")
    return row


results = []
for proj, (n, k) in PROJ.items():
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    results += [measure(proj, n, k, m, weights) for m in ROWS]
    weights.clear()
    torch.cuda.empty_cache()

out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "cutlass_gemm.json"), "w") as f:
    json.dump({"results": results, "configs": cfgs}, f, indent=1)
names = list(libs)
print("\n| proj | rows | cuBLAS | " + " | ".join(names) + " | best / cuBLAS |")
print("| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: |")
for r in results:
    cells = " | ".join(f"{r[c]:.1f}" if r[c] else "-" for c in names)
    ratio = best_cutlass(r) / r["cublas"]
    print(f"| {r['proj']} | {r['rows']} | {r['cublas']:.1f} | {cells} | {ratio:.3f} |")
print("\nstack (32 layers, four projections), ms: rows, cuBLAS, best of CUTLASS per projection, min of both")
for m in ROWS:
    rs = [r for r in results if r["rows"] == m]
    cb = sum(r["cublas"] for r in rs) * LAYERS / 1000
    bc = sum(best_cutlass(r) for r in rs) * LAYERS / 1000
    mn = sum(min(r["cublas"], best_cutlass(r)) for r in rs) * LAYERS / 1000
    print(f"{m:4d} {cb:6.2f} {bc:6.2f} {mn:6.2f}  ({mn / cb:.3f})")
print("configs:", json.dumps(cfgs))
