"""Gemma 2 and Gemma 3 (text) as variants of the Llama layers.

What differs from Llama: embeddings scaled by sqrt(hidden_size); RMSNorm that scales by
`1 + weight` in float32; a norm after attention and around the MLP (four per layer); a gelu-tanh
gated MLP; attention scaled by `query_pre_attn_scalar ** -0.5`; sliding-window and global layers
alternating as `layer_types` says. Gemma 2 soft-caps the attention scores and the final logits
(`cap * tanh(x / cap)`); Gemma 3 normalises Q and K per head instead, and gives sliding and
global layers rope settings of their own.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise and scale by (1 + weight), all in float32, as transformers' Gemma does."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1; optionally fused with the residual
    add, as `runtime.layers.layernorm.RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=ctx.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.eps)
        x = x + residual
        return gemma_rms_norm(x, self.weight, self.eps), x


class Gemma2Attention(LlamaAttention):
    norm_cls = GemmaRMSNorm

    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar ** -0.5


class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def rope_config(self, config, layer_idx: int):
        """Gemma 3's rope settings are per layer type ("sliding_attention", "full_attention")."""
        params = getattr(config, "rope_parameters", None) or {}
        layer_type = config.layer_types[layer_idx]
        if layer_type not in params:
            return config
        return SimpleNamespace(rope_parameters=params[layer_type],
                               max_position_embeddings=config.max_position_embeddings)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, ctx, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, ctx, f"{prefix}.mlp")
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, as the Llama layer: the sum of the two is the
        residual stream transformers carries."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma2Model(LlamaModel):
    layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def scale_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        # the normaliser is rounded to the activation dtype first, as in transformers
        return embeds * torch.tensor(self.hidden_size ** 0.5, dtype=embeds.dtype)


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
