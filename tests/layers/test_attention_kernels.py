"""Paged attention kernels (Triton) against the torch reference `paged_attention_torch`.

On the CPU through the Triton interpreter (float32, contexts of a few hundred, small tiles so
split-K, several key tiles and several query tiles all run), on CUDA in bf16 (contexts up to a
few thousand, the shipped tiling; `@pytest.mark.gpu`). Every case uses shuffled, non-contiguous
block ids and block tables longer than the context (blocks allocated ahead), and random (never zero)
caches and inputs. The interpreter switch is process-wide, so it is only set where
there is no GPU to leak into.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from helpers.sm90 import can_compile_sm90, run_compile_script
from helpers.triton_interp import needs_interp

from loraplex.layers.attention import paged_attention, paged_attention_torch
from loraplex.layers.attention_metadata import AttentionMetadata, attention_backend


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta_ref: AttentionMetadata
    meta_kernel: AttentionMetadata


def make_case(
    seqs: list[tuple[int, int]],  # (cached prefix length, query rows this step) per sequence
    n_q: int,
    n_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    block_size: int = 16,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(pre + n) // block_size) + 1 for pre, n in seqs]  # one block allocated ahead each
    num_blocks = sum(need) + 7
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: tables are non-contiguous
    tables, positions, slots, query_start, context_lens = [], [], [], [0], []
    for (pre, n), b in zip(seqs, need, strict=True):
        table, ids = ids[:b], ids[b:]
        tables.append(table)
        for pos in range(pre, pre + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + n)
        context_lens.append(pre + n)
    t = query_start[-1]

    dev_gen = gen if device == "cpu" else torch.Generator(device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    cache_shape = (num_blocks, block_size, n_kv, head_dim)
    args = (positions, slots, query_start, context_lens, tables, block_size, device)
    return Case(
        q=rnd(t, n_q, head_dim),
        k=rnd(t, n_kv, head_dim),
        v=rnd(t, n_kv, head_dim),
        k_cache=rnd(*cache_shape),  # the cached prefix (and garbage elsewhere: never read)
        v_cache=rnd(*cache_shape),
        meta_ref=AttentionMetadata.build(*args, for_kernels=False),
        meta_kernel=AttentionMetadata.build(*args, for_kernels=True),
    )


def check(case: Case, window: int | None, tol: float, tiling=None) -> None:  # noqa: ANN001
    from loraplex.layers.attention_triton import paged_attention_triton

    ref_dtype = torch.float64 if case.q.is_cuda else torch.float32
    up = [x.to(ref_dtype) for x in (case.q, case.k, case.v, case.k_cache, case.v_cache)]
    scale = case.q.shape[-1] ** -0.5
    ref = paged_attention_torch(*up, case.meta_ref, scale, window)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = paged_attention_triton(
        case.q, case.k, case.v, k_cache, v_cache, case.meta_kernel, scale, window, tiling
    )
    # the write: this step's rows landed where the reference put them, nothing else moved
    assert torch.equal(k_cache.to(ref_dtype), up[3]) and torch.equal(v_cache.to(ref_dtype), up[4])
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all()
    err = (out.to(ref_dtype) - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tol, err


# --- host-side: metadata and dispatch (no triton needed) -------------------------------------


def test_backend_choice() -> None:
    assert attention_backend("cpu") == "torch"
    assert attention_backend(torch.device("cuda")) == "triton"
    assert attention_backend("cuda:1") == "triton"


def test_metadata_build() -> None:
    case = make_case([(0, 1), (20, 3), (5, 1)], 2, 1, 8, torch.float32, "cpu", block_size=4, seed=3)
    mk, mr = case.meta_kernel, case.meta_ref
    assert (mk.max_query_len, mk.max_context_len, mk.num_decode_seqs) == (3, 23, 2)
    assert mk.block_table.dtype == torch.int32 and mk.block_table.shape == (3, 7)
    for i, table in enumerate(mk.block_tables):
        assert mk.block_table[i, : len(table)].tolist() == list(table)
        assert not mk.block_table[i, len(table) :].any()  # padding: block 0
        pos = torch.arange(mk.context_lens[i])
        expect = torch.tensor(table)[pos // 4] * 4 + pos % 4
        assert torch.equal(mr.kv_indices[i], expect)
    assert mk.context_lens_t.tolist() == [1, 23, 6] and mk.query_start_t.tolist() == [0, 1, 4, 5]
    assert mr.block_table is None and mk.kv_indices == ()


def test_cpu_dispatch_is_the_reference() -> None:
    case = make_case([(0, 5), (9, 1)], 4, 2, 16, torch.float32, "cpu", block_size=4)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    a = paged_attention(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta_ref, 0.25, None)
    b = paged_attention_torch(case.q, case.k, case.v, kc, vc, case.meta_ref, 0.25, None)
    assert torch.equal(a, b)


def test_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import loraplex, loraplex.model.llama, loraplex.engine.model_runner\n"
        "assert 'loraplex.layers.attention_triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90() -> None:
    """The compiler, not only the interpreter, accepts the kernels (no GPU needed)."""
    run_compile_script("layers.sm90_compile")


# --- the kernels in the interpreter (float32) ------------------------------------------------

INTERP_CASES = {
    "decode": [(0, 1), (16, 1), (99, 1), (300, 1), (33, 1)],  # contexts 1 .. 301
    "prefill": [(0, 37), (0, 16), (0, 2)],
    "mixed": [(0, 1), (40, 19), (200, 1), (15, 2), (0, 20), (7, 1)],  # chunks continue a cached prefix
}
HEADS = {"gqa8": (16, 2), "mqa": (4, 1)}


def _interp_tiling():  # noqa: ANN202
    from loraplex.layers.attention_tiling import AttentionTiling

    # small tiles: several key / query tiles per program; split-K from 64 keys on a 4-"SM" machine
    return AttentionTiling(
        decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_keys_per_split=32, programs_per_sm=8
    )


@needs_interp
@pytest.mark.parametrize(
    ("kind", "window"), [("decode", None), ("prefill", None), ("mixed", None), ("mixed", 24)]
)
@pytest.mark.parametrize("heads", list(HEADS))
def test_interp(kind: str, window: int | None, heads: str) -> None:
    n_q, n_kv = HEADS[heads]
    case = make_case(INTERP_CASES[kind], n_q, n_kv, 32, torch.float32, "cpu", seed=len(kind))
    check(case, window, 1e-4, _interp_tiling())


@needs_interp
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 24: padded to 32 inside the kernels (Mistral's tiny)
def test_interp_head_dims(head_dim: int) -> None:
    seqs = [(0, 1), (40, 19), (200, 1), (7, 2)]
    case = make_case(seqs, 8, 1, head_dim, torch.float32, "cpu", block_size=8, seed=5)
    check(case, None, 1e-4, _interp_tiling())


@needs_interp
def test_interp_default_tiling_and_split_choice() -> None:
    from loraplex.layers.attention_tiling import DEFAULT_TILING, decode_splits

    # Llama-3-8B decode at batch 64: 512 programs already fill 132 SMs, no split
    assert decode_splits(64, 8, 1024, 132, DEFAULT_TILING) == 1
    assert decode_splits(1, 8, 32768, 132, DEFAULT_TILING) == 32
    assert decode_splits(4, 8, 300, 132, DEFAULT_TILING) == 1  # too short to split
    case = make_case(INTERP_CASES["mixed"], 4, 2, 32, torch.float32, "cpu", seed=9)
    check(case, 50, 1e-4)


# --- the kernels on the GPU (bf16) -----------------------------------------------------------


def _gpu_cases(seed: int) -> dict[str, list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(seed)
    decode = [(int(c), 1) for c in torch.randint(0, 4000, (40,), generator=g)] + [(0, 1), (4095, 1)]
    return {
        "decode": decode,
        "decode_small_batch": [(3000, 1), (17, 1)],  # split-K
        "prefill": [(0, 1000), (0, 77), (0, 2), (0, 513)],
        "mixed": decode[:24] + [(2000, 512), (0, 1), (300, 45), (1, 129), (3, 2)],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "decode_small_batch", "prefill", "mixed"])
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(32, 4, 128), (8, 1, 64), (16, 2, 256)])
@pytest.mark.parametrize("window", [None, 700])
def test_gpu_bf16(kind: str, n_q: int, n_kv: int, head_dim: int, window: int | None) -> None:
    case = make_case(_gpu_cases(1)[kind], n_q, n_kv, head_dim, torch.bfloat16, "cuda", seed=head_dim)
    check(case, window, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype: torch.dtype) -> None:
    case = make_case(_gpu_cases(2)["mixed"], 32, 8, 128, dtype, "cuda", seed=11)
    check(case, None, 1e-4 if dtype == torch.float32 else 5e-3)


@pytest.mark.gpu
def test_gpu_dispatch_uses_kernels() -> None:
    case = make_case(_gpu_cases(3)["mixed"], 32, 8, 128, torch.bfloat16, "cuda")
    # the reference cannot run on kernel metadata (no kv_indices): a result proves the kernels ran
    out = paged_attention(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta_kernel, 0.1, None)
    assert out.shape == case.q.shape


def _padded_static(case: Case, pad: int, bound: int) -> tuple[torch.Tensor, ...]:
    """The case's decode rows plus `pad` padding rows as a captured step lays them out (slot -1,
    no context), with the decode launch sized for `bound` keys; returns (q, k, v, meta)."""
    m = case.meta_kernel
    n, width = m.block_table.shape
    extra = lambda x: torch.cat([x, torch.randn(pad, *x.shape[1:]).to(x)])  # noqa: E731
    q, k, v = extra(case.q), extra(case.k), extra(case.v)
    meta = AttentionMetadata(
        positions=torch.cat([m.positions, torch.zeros(pad, dtype=torch.int64)]),
        slot_mapping=torch.cat([m.slot_mapping, torch.full((pad,), -1)]),
        query_start=tuple(range(n + pad + 1)),
        context_lens=(0,) * (n + pad),
        kv_indices=(),
        block_tables=(),
        block_table=torch.cat([m.block_table, torch.zeros(pad, width, dtype=torch.int32)]),
        context_lens_t=torch.cat([m.context_lens_t, torch.zeros(pad, dtype=torch.int32)]),
        query_start_t=torch.arange(n + pad + 1, dtype=torch.int32),
        max_query_len=1,
        max_context_len=bound,
        num_decode_seqs=n + pad,
        static=True,
    )
    return q, k, v, meta


@needs_interp
def test_interp_static_decode_with_padding_rows() -> None:
    from loraplex.layers.attention_triton import paged_attention_triton

    # a captured decode step: launch sized for a bound far above the real contexts (many splits,
    # most of them empty), two padding rows that must write nothing and read nothing
    case = make_case([(0, 1), (70, 1), (33, 1)], 4, 2, 32, torch.float32, "cpu", seed=13)
    q, k, v, meta = _padded_static(case, pad=2, bound=1024)
    scale = 32**-0.5
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    ref = paged_attention_torch(case.q, case.k, case.v, ref_k, ref_v, case.meta_ref, scale, None)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = paged_attention_triton(q, k, v, k_cache, v_cache, meta, scale, None, _interp_tiling())
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # padding wrote nothing
    assert (out[:3] - ref).abs().max() <= 1e-4
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    # the torch reference runs the same static metadata (reading its device tensors)
    k2, v2 = case.k_cache.clone(), case.v_cache.clone()
    out_ref = paged_attention_torch(q, k, v, k2, v2, meta, scale, None)
    assert torch.equal(k2, ref_k) and (out_ref[:3] - ref).abs().max() <= 1e-6
    assert torch.equal(out_ref[3:], torch.zeros_like(out_ref[3:]))


def _mixed_static(case: Case, pad_rows: int, pad_seqs: int, tile_rows: int, bound: int) -> tuple:
    """The case's sequences as a captured mixed step lays them out: `pad_rows` padding rows past
    the last sequence's (no sequence, slot -1), `pad_seqs` empty sequences, the prefill launch's
    tile map with capacity for every row tile plus spare entries (-1); returns (q, k, v, meta)."""
    m = case.meta_kernel
    n, width = m.block_table.shape
    rows = int(m.query_start_t[-1])
    dev = case.q.device
    extra = lambda x: torch.cat([x, torch.randn(pad_rows, *x.shape[1:]).to(x)])  # noqa: E731
    i32 = lambda x: x.to(torch.int32).to(dev)  # noqa: E731
    starts = m.query_start_t.tolist()
    tiles = []
    for s in range(n):
        q_len = starts[s + 1] - starts[s]
        if q_len >= 2:
            tiles += [s * 65536 + t for t in range(-(-q_len // tile_rows))]
    capacity = -(-(rows + pad_rows) // tile_rows) + n + pad_seqs
    return (
        extra(case.q),
        extra(case.k),
        extra(case.v),
        AttentionMetadata(
            positions=torch.cat([m.positions, torch.zeros(pad_rows, dtype=torch.int64, device=dev)]),
            slot_mapping=torch.cat([m.slot_mapping, torch.full((pad_rows,), -1, device=dev)]),
            query_start=tuple(range(n + pad_seqs + 1)),  # the captured shape only
            context_lens=(0,) * (n + pad_seqs),
            kv_indices=(),
            block_tables=(),
            block_table=torch.cat([m.block_table, i32(torch.zeros(pad_seqs, width))]),
            context_lens_t=torch.cat([m.context_lens_t, i32(torch.zeros(pad_seqs))]),
            query_start_t=torch.cat([m.query_start_t, i32(torch.full((pad_seqs,), rows))]),
            max_query_len=rows + pad_rows,
            max_context_len=bound,
            num_decode_seqs=n + pad_seqs,
            static=True,
            prefill_tiles=torch.tensor(tiles + [-1] * (capacity - len(tiles)), dtype=torch.int32, device=dev),
            prefill_tile_rows=tile_rows,
        ),
    )


@needs_interp
@pytest.mark.parametrize("spare", [2, -2])
def test_interp_static_mixed_step_with_tile_map(monkeypatch: pytest.MonkeyPatch, spare: int) -> None:
    from loraplex.layers import attention_triton
    from loraplex.layers.attention_triton import paged_attention_triton

    # -2: the programs before the decode ones hold fewer entries than the map has real tiles, so
    # the rest must run in the programs after the decode ones
    monkeypatch.setattr(attention_triton, "SPARE_TILE_ENTRIES", spare)

    real_empty = torch.empty

    def nan_empty(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    # fresh memory holds NaNs here, so only rows a launch wrote come out finite
    monkeypatch.setattr(torch, "empty", nan_empty)

    # a captured mixed step: decode rows (one long enough to split its keys), a chunk continuing a
    # cached prefix and a first chunk (several query tiles), 5 padding rows and 2 empty sequences
    # that must write and read nothing; decode and prefill programs in one launch
    case = make_case([(40, 1), (20, 37), (150, 1), (0, 1), (0, 18)], 4, 2, 32, torch.float32, "cpu", seed=17)
    q, k, v, meta = _mixed_static(case, pad_rows=5, pad_seqs=2, tile_rows=16, bound=512)
    scale = 32**-0.5
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    ref = paged_attention_torch(case.q, case.k, case.v, ref_k, ref_v, case.meta_ref, scale, None)
    rows = ref.shape[0]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = paged_attention_triton(q, k, v, k_cache, v_cache, meta, scale, None, _interp_tiling())
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # padding wrote nothing
    assert (out[:rows] - ref).abs().max() <= 1e-4  # (padding rows: unwritten, NaN here)
    # the torch reference runs the same static metadata (reading its device tensors)
    k2, v2 = case.k_cache.clone(), case.v_cache.clone()
    out_ref = paged_attention_torch(q, k, v, k2, v2, meta, scale, None)
    assert torch.equal(k2, ref_k) and (out_ref[:rows] - ref).abs().max() <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("spare", [2, -4])
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(32, 8, 128), (16, 2, 256)])
def test_gpu_static_mixed_step_in_one_launch(
    monkeypatch: pytest.MonkeyPatch, n_q: int, n_kv: int, head_dim: int, spare: int
) -> None:
    """A captured mixed step's one launch at serving sizes, in bf16: 40 decode rows at contexts up
    to 3,000 (split over their keys with 2 kv heads), a 320-row chunk after 600 cached tokens, a
    new 130-token prompt, 30 padding rows, 3 empty sequences; the shipped tiling. spare=-4: the
    programs before the decode ones take 5 of the map's 8 real entries, the last 3 run after."""
    from loraplex.layers import attention_triton
    from loraplex.layers.attention_triton import paged_attention_triton

    monkeypatch.setattr(attention_triton, "SPARE_TILE_ENTRIES", spare)

    g = torch.Generator().manual_seed(4)
    seqs = [(int(c), 1) for c in torch.randint(1, 3000, (40,), generator=g)] + [(600, 320), (0, 130)]
    case = make_case(seqs, n_q, n_kv, head_dim, torch.bfloat16, "cuda", seed=head_dim)
    q, k, v, meta = _mixed_static(case, pad_rows=30, pad_seqs=3, tile_rows=64, bound=4096)
    up = [x.double() for x in (case.q, case.k, case.v, case.k_cache, case.v_cache)]
    scale = head_dim**-0.5
    ref = paged_attention_torch(*up, case.meta_ref, scale, None)
    rows = ref.shape[0]
    out = paged_attention_triton(q, k, v, case.k_cache.clone(), case.v_cache.clone(), meta, scale, None)
    assert torch.isfinite(out[:rows]).all()
    assert ((out[:rows].double() - ref).abs().max() / ref.abs().max()).item() <= 2e-2


def test_one_factory_picks_the_attention_backend() -> None:
    from loraplex.layers.attention import make_attention_backend

    cpu = make_attention_backend("cpu")
    assert cpu.name == attention_backend("cpu") == "torch"
    assert make_attention_backend("cpu") is cpu  # built once per device type
    if torch.cuda.is_available():
        assert make_attention_backend("cuda").name == "triton"
