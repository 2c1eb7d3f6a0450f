"""The Llama family (Llama, Mistral, Qwen2, Qwen3) in the execution layout.

Differences inside the family are configuration, not code: GQA/MQA and explicit head_dim, q/k/v
(and o) biases, Qwen3's per-head q/k RMSNorm, sliding windows, tied embeddings, RoPE scaling.
q/k/v run as one fused projection and gate/up as another; LoRA adapters still target each
logical projection through the output slices of the fused layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.attention import paged_attention
from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.layers.fused import fused_ops, use_fused
from loraplex.layers.linear import ColumnParallelLinear, RowParallelLinear
from loraplex.layers.norm import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.lora.step import LoRAContext


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_sliding_windows[layer]
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            cfg.q_size + 2 * cfg.kv_size,
            bias=cfg.attention_bias,
            layer=layer,
            group="qkv",
            slice_sizes=(cfg.q_size, cfg.kv_size, cfg.kv_size),
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            cfg.q_size,
            cfg.hidden_size,
            bias=cfg.o_proj_bias,
            layer=layer,
            group="o",
            slice_sizes=(cfg.hidden_size,),
            dtype=dtype,
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoRAContext | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [T, hidden]; residual: the stream o's output is added to next (the LoRA op may add
        # o's LoRA output into it directly)
        t = x.shape[0]
        qkv = self.qkv_proj(x, lora)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q = qkv[:, :q_size].reshape(t, self.n_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(t, self.n_kv, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(t, self.n_kv, self.head_dim)
        q, k = rotary(attn.positions, q, k, attn.max_context_len, self.q_norm, self.k_norm)
        # v stays a strided view of qkv: both attention paths read it in place (no copy kernel)
        o = paged_attention(q, k, v, k_cache, v_cache, attn, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, q_size), lora, residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            2 * i,
            bias=cfg.mlp_bias,
            layer=layer,
            group="gate_up",
            slice_sizes=(i, i),
            dtype=dtype,
        )
        self.down_proj = RowParallelLinear(
            i,
            cfg.hidden_size,
            bias=cfg.mlp_bias,
            layer=layer,
            group="down",
            slice_sizes=(cfg.hidden_size,),
            dtype=dtype,
        )
        self.intermediate = i

    def forward(
        self, x: torch.Tensor, lora: LoRAContext | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        # residual: the stream down's output is added to next (see Attention.forward); gate_up's
        # LoRA output may come back as a delta, which the activation adds
        gate_up, delta = self.gate_up_proj.forward_deferred(x, lora)
        if use_fused(gate_up):
            h = fused_ops().silu_mul(gate_up, delta)
        else:
            if delta is not None:
                gate_up = gate_up + delta
            h = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return self.down_proj(h, lora, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, dtype)
        self.mlp = MLP(cfg, layer, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoRAContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering this layer is hidden + residual (just hidden for the first
        layer, residual None). Returns (MLP output, residual stream before it): the add is left to
        the next norm, which fuses it (on CUDA updating `residual` in place)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_add(hidden, residual)
        hidden = self.self_attn(hidden, rotary, k_cache, v_cache, attn, lora, residual)
        hidden, residual = self.post_attention_layernorm.forward_add(hidden, residual)
        return self.mlp(hidden, lora, residual), residual


class LlamaFamilyModel(nn.Module):
    """forward() maps token rows to final hidden states; logits() applies the LM head to selected rows."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attn: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        lora: LoRAContext | None,
        hidden_capture: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids: [T] -> final normed hidden states [T, hidden].

        hidden_capture, if given, receives the residual stream entering each layer i (key i) and
        the final normed output (key num_layers), for layer-by-layer comparisons.
        """
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if hidden_capture is not None:
                # fresh tensors: the fused norms update the residual stream in place
                hidden_capture[i] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, self.rotary, k_caches[i], v_caches[i], attn, lora)
        hidden = self.norm(hidden) if residual is None else self.norm.forward_add(hidden, residual)[0]
        if hidden_capture is not None:
            hidden_capture[len(self.layers)] = hidden
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight)
