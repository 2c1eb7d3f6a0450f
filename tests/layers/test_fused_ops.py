"""Fused elementwise kernels (`fused_triton.py`) against the torch code they replace.

On the CPU through the Triton interpreter (float32 and float16; the interpreter has no bf16), on
CUDA in bf16 and at Llama-3-8B sizes (`@pytest.mark.gpu`), plus the model with and without the
kernels and a CUDA-graph replay. Residual sums and RoPE keep the torch code's rounding points and
are compared exactly; the norms and SiLU reduce or exponentiate in another order or
implementation, so they are compared to within one unit in the last place of the activation dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.sm90 import can_compile_sm90, run_compile_script
from helpers.triton_interp import needs_interp

from loraplex.config import RopeConfig
from loraplex.layers.norm import rms_norm_torch
from loraplex.layers.rotary import RotaryEmbedding, rope_torch

ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
EPS = 1e-5
ROWS = [0, 1, 5, 64]


def _ops():  # noqa: ANN202
    from loraplex.layers import fused_triton

    return fused_triton


def _rand(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def _assert_ulp(actual: torch.Tensor, expected: torch.Tensor, min_equal: float = 0.9) -> None:
    """Within a rounding step or two of the dtype everywhere, and for 16-bit dtypes mostly
    bit-identical (float32 results differ in their last bits wherever the reduction does)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel() == 0:
        return
    eps = torch.finfo(expected.dtype).eps
    # a float32 intermediate differing in its last bits can flip one rounding of a 16-bit result;
    # float32 results carry those bits (a few ulp: the GPU's exp is an approximation)
    rtol = 1e-6 if expected.dtype == torch.float32 else 2 * eps
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=2 * rtol)
    if expected.dtype != torch.float32:
        assert (actual == expected).float().mean().item() >= min_equal


# --- references and cases, shared by the interpreter and the GPU tests -------------------------


def check_norms(t: int, d: int, dtype: torch.dtype, device: str) -> None:
    ops = _ops()
    x = _rand(t, d, dtype=dtype, device=device, seed=t + d)
    res = _rand(t, d, dtype=dtype, device=device, seed=t + d + 1, scale=4.0)
    w = _rand(d, dtype=dtype, device=device, seed=d, scale=0.5) + 1
    _assert_ulp(ops.rmsnorm(x, w, EPS), rms_norm_torch(x, w, EPS))
    ref_res = res + x
    out = ops.fused_add_rmsnorm(x, res, w, EPS)
    assert torch.equal(res, ref_res)  # the sum, updated in place, as torch rounds it
    _assert_ulp(out, rms_norm_torch(ref_res, w, EPS))
    # a row-strided view (a slice of a wider tensor) and a 3-D input
    wide = _rand(t, d + 40, dtype=dtype, device=device, seed=3)
    _assert_ulp(ops.rmsnorm(wide[:, 8 : 8 + d], w, EPS), rms_norm_torch(wide[:, 8 : 8 + d], w, EPS))
    x3 = x.reshape(t, 1, d).expand(t, 3, d)
    _assert_ulp(ops.rmsnorm(x3, w, EPS), rms_norm_torch(x3, w, EPS))


def check_rotary(
    t: int, n_q: int, n_kv: int, d: int, dtype: torch.dtype, device: str, qk_norm: bool = False
) -> None:
    ops = _ops()
    rotary = RotaryEmbedding(ROPE, d, max_positions=300).to(device)
    table = rotary.cos_sin_cache()
    assert table.shape == (300, d) and table.dtype == torch.float32
    qkv = _rand(t, (n_q + 2 * n_kv) * d, dtype=dtype, device=device, seed=t * 7 + d, scale=3.0)
    q_size, kv_size = n_q * d, n_kv * d
    # strided views into the fused projection's output, as the model makes them
    q = qkv[:, :q_size].reshape(t, n_q, d)
    k = qkv[:, q_size : q_size + kv_size].reshape(t, n_kv, d)
    v_before = qkv[:, q_size + kv_size :].clone()
    gen = torch.Generator().manual_seed(t)
    positions = torch.randint(0, 300, (t,), generator=gen).to(device)  # unsorted, repeats
    ref_q, ref_k = q, k
    qn = kn = None
    if qk_norm:  # Qwen3's per-head norms, applied before the rotation
        qn, kn = ((_rand(d, dtype=dtype, device=device, seed=i, scale=0.5) + 1, EPS) for i in range(2))
        ref_q, ref_k = rms_norm_torch(q, *qn), rms_norm_torch(k, *kn)
    ref_q, ref_k = rope_torch(positions, rotary.inv_freq, ref_q, ref_k)
    ops.rotary_qk_(q, k, positions, table, qn, kn)
    if qk_norm:  # the per-head norm rounds like the other norms
        _assert_ulp(q, ref_q, min_equal=0.8)
        _assert_ulp(k, ref_k, min_equal=0.8)
    else:
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)  # v untouched


def check_silu_mul(t: int, i: int, dtype: torch.dtype, device: str) -> None:
    gate_up = _rand(t, 2 * i, dtype=dtype, device=device, seed=t + i, scale=3.0)
    ref = F.silu(gate_up[:, :i]) * gate_up[:, i:]
    out = _ops().silu_mul(gate_up)
    assert out.is_contiguous()
    _assert_ulp(out, ref)
    wide = _rand(t, 2 * i + 6, dtype=dtype, device=device, seed=1)[:, 3 : 3 + 2 * i]  # row-strided
    _assert_ulp(_ops().silu_mul(wide), F.silu(wide[:, :i]) * wide[:, i:])
    # with a delta (a concurrent LoRA step's gate_up output), added first in the activation dtype
    delta = _rand(t, 2 * i + 2, dtype=dtype, device=device, seed=2, scale=0.5)[:, 1 : 1 + 2 * i]
    summed = gate_up + delta
    _assert_ulp(_ops().silu_mul(gate_up, delta), F.silu(summed[:, :i]) * summed[:, i:])


# --- the interpreter (CPU) ---------------------------------------------------------------------

INTERP_DTYPES = [torch.float32, torch.float16]


@needs_interp
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("d", [64, 96])  # 96: a row padded to the next power of two
def test_interp_norms(t: int, d: int, dtype: torch.dtype) -> None:
    check_norms(t, d, dtype, "cpu")


@needs_interp
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(4, 2, 16), (8, 1, 24), (3, 3, 64)])
def test_interp_rotary(t: int, n_q: int, n_kv: int, d: int, dtype: torch.dtype) -> None:
    check_rotary(t, n_q, n_kv, d, dtype, "cpu")


@needs_interp
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("t", [0, 5, 64])
def test_interp_rotary_with_qk_norm(t: int, dtype: torch.dtype) -> None:
    check_rotary(t, 4, 2, 32, dtype, "cpu", qk_norm=True)


@needs_interp
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("i", [8, 100, 1500])  # 1500: two column blocks per row
def test_interp_silu_mul(t: int, i: int, dtype: torch.dtype) -> None:
    check_silu_mul(t, i, dtype, "cpu")


def test_rope_table_matches_the_torch_path() -> None:
    """The table's cos/sin are the values the torch path computes per call, bit for bit, and
    it grows (to a power of two) past max_positions."""
    rotary = RotaryEmbedding(ROPE, 64, max_positions=100)
    positions = torch.tensor([0, 1, 7, 99, 50])
    freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
    table = rotary.cos_sin_cache()
    assert table.shape == (100, 64)
    assert torch.equal(table[positions], torch.cat((freqs.cos(), freqs.sin()), dim=-1))
    assert rotary.cos_sin_cache(100) is table
    assert rotary.cos_sin_cache(101).shape == (128, 64)


def test_cpu_path_imports_no_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, loraplex.layers, loraplex.model.llama\n"
        "from loraplex.config import RopeConfig\n"
        "from loraplex.layers.norm import RMSNorm\n"
        "from loraplex.layers.rotary import RotaryEmbedding, rope_torch\n"
        "n = RMSNorm(8, 1e-5, torch.float32)\n"
        "n.forward_add(torch.ones(2, 8), torch.ones(2, 8))\n"
        "RotaryEmbedding(RopeConfig(), 8)(torch.arange(2), torch.ones(2, 2, 8), torch.ones(2, 1, 8))\n"
        "assert 'loraplex.layers.fused_triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90() -> None:
    """The compiler, not only the interpreter, accepts the kernels (no GPU needed)."""
    run_compile_script("layers.sm90_compile_fused")


# --- CUDA (bf16) ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [0, 1, 64, 300])
def test_gpu_ops(t: int, dtype: torch.dtype) -> None:
    check_norms(t, 4096, dtype, "cuda")
    check_silu_mul(t, 14336, dtype, "cuda")
    check_rotary(t, 32, 8, 128, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(32, 8, 128), (64, 8, 128), (16, 2, 256), (8, 1, 24)])
def test_gpu_rotary_shapes(n_q: int, n_kv: int, d: int) -> None:
    check_rotary(37, n_q, n_kv, d, torch.bfloat16, "cuda")
    check_rotary(37, n_q, n_kv, d, torch.bfloat16, "cuda", qk_norm=True)


@pytest.mark.gpu
def test_gpu_graph_replay() -> None:
    """Captured once, replayed on new inputs written into the same buffers: no host syncs or
    value-dependent allocations inside."""
    ops = _ops()
    t, d, n_q, n_kv, hd = 16, 256, 4, 2, 64
    x, res = (_rand(t, d, dtype=torch.bfloat16, device="cuda", seed=s) for s in (1, 2))
    w = torch.ones(d, dtype=torch.bfloat16, device="cuda")
    qkv = _rand(t, (n_q + 2 * n_kv) * hd, dtype=torch.bfloat16, device="cuda", seed=3)
    positions = torch.arange(t, device="cuda")
    table = RotaryEmbedding(ROPE, hd, max_positions=64).to("cuda").cos_sin_cache()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        q = qkv[:, : n_q * hd].view(t, n_q, hd)
        k = qkv[:, n_q * hd : (n_q + n_kv) * hd].view(t, n_kv, hd)
        ops.rotary_qk_(q, k, positions, table)
        return ops.fused_add_rmsnorm(x, res, w, EPS), ops.silu_mul(qkv[:, : 2 * d])

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (10, 20):
        for buf, s in ((x, seed), (res, seed + 1), (qkv, seed + 2)):
            buf.copy_(_rand(*buf.shape, dtype=buf.dtype, device="cuda", seed=s))
        positions.copy_(torch.randint(0, 64, (t,), device="cuda"))
        x0, res0, qkv0 = x.clone(), res.clone(), qkv.clone()
        graph.replay()
        expect = [t_.clone() for t_ in out]
        for buf, saved in ((x, x0), (res, res0), (qkv, qkv0)):
            buf.copy_(saved)
        eager = step()
        assert all(torch.equal(a, b) for a, b in zip(expect, eager, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_gpu_model_with_and_without_fused_ops(arch: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The whole model on CUDA in bf16: fused vs the torch path, layer by layer."""
    from helpers.tiny_models import build_hf_model, save_hf_model

    from loraplex.layers import fused
    from loraplex.layers.attention_metadata import AttentionMetadata
    from loraplex.model.loader import load_model

    path = save_hf_model(build_hf_model(arch, seed=5), tmp_path / "m")
    model = load_model(path, torch.bfloat16, "cuda")
    cfg = model.config
    t, bs = 40, 4
    ids = torch.randint(3, 97, (t,), generator=torch.Generator().manual_seed(1)).cuda()
    meta = AttentionMetadata.build(list(range(t)), list(range(t)), [0, t], [t], [list(range(10))], bs, "cuda")
    captures = []
    for enabled in (True, False):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        caches = [torch.zeros(16, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16,
                              device="cuda") for _ in range(2 * cfg.num_hidden_layers)]  # fmt: skip
        cap: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            model(ids, meta, caches[::2], caches[1::2], None, cap)
        captures.append(cap)
    fused_cap, torch_cap = captures
    assert fused_cap.keys() == torch_cap.keys()
    for i in fused_cap:
        err = (fused_cap[i].float() - torch_cap[i].float()).abs().max().item()
        scale = torch_cap[i].float().abs().max().item()
        assert err <= 0.02 * scale, f"{arch}: hidden {i} differs by {err} (max {scale})"
