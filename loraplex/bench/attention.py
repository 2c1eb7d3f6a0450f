"""Paged attention micro-bench on CUDA: the Triton kernels against their floors and the torch paths.

    python -m loraplex.bench.attention [--out DIR]

Cases use Llama-3-8B attention shapes (32 query heads, 8 kv heads, head_dim 128), bf16, block size
16, shuffled block ids. Decode rows report time against the bytes floor: K and V of every context
read once / the device-to-device copy bandwidth measured in the same process (bytes read + bytes
written over a 2 GiB copy). Prefill rows report TFLOP/s (causal: half the score matrix, 4 flops per
multiply-add pair of QK^T and PV). The torch reference (`paged_attention_torch`, a per-sequence
loop) and PyTorch's own SDPA on the same data laid out densely (no paging; flash/efficient
kernels where it picks them) are timed for comparison. Writes `attention.json` under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.layers.attention import paged_attention_torch
from loraplex.layers.attention_metadata import AttentionMetadata

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _median_us(fn, rep_ms: int = 200) -> float:  # noqa: ANN001
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth_gbs() -> float:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB, not zeros
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def _case(seqs: list[tuple[int, int]], with_ref: bool, seed: int = 0):  # noqa: ANN202
    """(prefix, rows) per sequence -> q, k, v, caches, kernel metadata, reference metadata."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(pre + n) // BLOCK_SIZE) for pre, n in seqs]
    ids = torch.randperm(sum(need), generator=gen).tolist()
    tables, positions, slots, qs, ctx = [], [], [], [0], []
    for (pre, n), b in zip(seqs, need, strict=True):
        table, ids = ids[:b], ids[b:]
        tables.append(table)
        for p in range(pre, pre + n):
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qs.append(qs[-1] + n)
        ctx.append(pre + n)
    t = qs[-1]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=DTYPE)

    cache = (sum(need), BLOCK_SIZE, HKV, HEAD_DIM)
    args = (positions, slots, qs, ctx, tables, BLOCK_SIZE, "cuda")
    return dict(
        q=rnd(t, HQ, HEAD_DIM),
        k=rnd(t, HKV, HEAD_DIM),
        v=rnd(t, HKV, HEAD_DIM),
        k_cache=rnd(*cache),
        v_cache=rnd(*cache),
        meta=AttentionMetadata.build(*args, for_kernels=True),
        meta_ref=AttentionMetadata.build(*args, for_kernels=False) if with_ref else None,
        seqs=seqs,
    )


def _dense_sdpa(c: dict):  # noqa: ANN202
    """PyTorch SDPA over the same K/V laid out densely (equal-length sequences only)."""
    seqs = c["seqs"]
    s, n = len(seqs), seqs[0][1]
    length = seqs[0][0] + n
    q = c["q"].view(s, n, HQ, HEAD_DIM).transpose(1, 2).contiguous()
    k = torch.randn(s, HKV, length, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    causal = n > 1 and seqs[0][0] == 0
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def run(out_dir: Path | None) -> list[dict]:
    from loraplex.layers.attention_triton import paged_attention_triton

    bw = copy_bandwidth_gbs()
    scale = HEAD_DIM**-0.5
    rows: list[dict] = []
    cases = {
        "decode S=64 ctx=1024": ([(1023, 1)] * 64, True),
        "decode S=256 ctx=2048": ([(2047, 1)] * 256, False),
        "decode S=4 ctx=16384 (split-K)": ([(16383, 1)] * 4, False),
        "prefill S=4 q=2048 (new)": ([(0, 2048)] * 4, False),
        "prefill S=8 q=512 after 1536 cached": ([(1536, 512)] * 8, False),
    }
    for label, (seqs, with_ref) in cases.items():
        c = _case(seqs, with_ref)
        args = (c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"])
        kern_us = _median_us(functools.partial(paged_attention_triton, *args, c["meta"], scale, None))
        row: dict = dict(case=label, triton_us=kern_us)
        ctx_total = sum(p + n for p, n in seqs)
        kv_bytes = 2 * ctx_total * HKV * HEAD_DIM * 2
        if seqs[0][1] == 1:
            row["floor_us"] = kv_bytes / (bw * 1e9) * 1e6
            row["vs_floor"] = kern_us / row["floor_us"]
            row["gbs"] = kv_bytes / (kern_us * 1e-6) / 1e9
        else:
            flops = sum(4 * HQ * HEAD_DIM * n * (p + (n + 1) / 2) for p, n in seqs)
            row["tflops"] = flops / (kern_us * 1e-6) / 1e12
        if with_ref:
            m_ref = c["meta_ref"]
            row["torch_ref_us"] = _median_us(
                functools.partial(paged_attention_torch, *args, m_ref, scale, None), 100
            )
        try:
            row["sdpa_dense_us"] = _median_us(_dense_sdpa(c))
        except RuntimeError as e:  # an SDPA backend refusing the shape: report, do not fail the bench
            row["sdpa_dense_us"] = math.nan
            row["sdpa_error"] = str(e)[:200]
        rows.append(row)
        del c
        torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bw_gbs=bw,
        shapes=dict(hq=HQ, hkv=HKV, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype="bf16"),
        rows=rows,
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
    shape = f"Hq={HQ} Hkv={HKV} D={HEAD_DIM} bf16 bs={BLOCK_SIZE}"
    print(f"\ndevice {result['device']}  copy bandwidth {bw:.0f} GB/s  ({shape})")
    print(f"{'case':38s} {'triton us':>10s} {'floor us':>9s} {'x floor':>8s} {'GB/s|TF/s':>10s} "
          f"{'torch ref':>10s} {'sdpa dense':>10s}")  # fmt: skip
    for r in rows:
        rate = r.get("gbs", r.get("tflops", math.nan))
        print(
            f"{r['case']:38s} {r['triton_us']:10.1f} {r.get('floor_us', math.nan):9.1f} "
            f"{r.get('vs_floor', math.nan):8.2f} {rate:10.1f} {r.get('torch_ref_us', math.nan):10.1f} "
            f"{r['sdpa_dense_us']:10.1f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    run(ap.parse_args().out)


if __name__ == "__main__":
    main()
