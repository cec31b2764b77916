"""Llama 4 (text): the Llama layers with

- rope on most layers, rotating interleaved pairs of dims (transformers' complex-number form),
  then an L2 norm without weight on Q and K (`use_qk_norm`);
- NoPE layers (`no_rope_layers[i] == 0`): no rotation; with `attn_temperature_tuning` each
  query is scaled by `1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`, its position
  taken from the batch;
- chunked attention on the rope layers (`layer_types` "chunked_attention"): a token sees only
  the keys of its own `attention_chunk_size` chunk of positions, which the attention backend
  applies;
- MoE layers (`moe_layers`) between dense ones (`intermediate_size_mlp`): a router whose top-k
  logits go through a sigmoid, each token entering its experts scaled by that weight, plus a
  shared expert on every token. The checkpoint stacks the experts [E, in, out].
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import ReplicatedLinear
from runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from runtime.models.moe import MoeForCausalLM


def rotate_interleaved(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                       head_size: int) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of every head of x [T, heads * head_size] by the
    angle of frequency i at its position, in float32; the cache holds [cos | sin] per
    position."""
    t = x.size(0)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, head_size / 2] each
    pairs = x.float().view(t, -1, head_size // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.view(t, -1).to(x.dtype)


def l2_norm(x: torch.Tensor, head_size: int, eps: float) -> torch.Tensor:
    """RMS-normalise each head of x [T, heads * head_size] in float32, with no weight."""
    heads = x.float().view(x.size(0), -1, head_size)
    heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
    return heads.view_as(x).to(x.dtype)


class Llama4Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.l2_qk_norm = bool(config.use_qk_norm) and self.use_rope
        self.eps = config.rms_norm_eps
        self.temperature_tuning = bool(config.attn_temperature_tuning) and not self.use_rope
        self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale

    def attention_chunk_size(self, config, layer_idx: int) -> int | None:
        if config.layer_types[layer_idx] == "chunked_attention":
            return config.attention_chunk_size
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        if self.use_rope:
            cache = self.rotary_emb.cos_sin_cache
            q = rotate_interleaved(positions, q, cache, self.head_size)
            k = rotate_interleaved(positions, k, cache, self.head_size)
            if self.l2_qk_norm:
                q = l2_norm(q, self.head_size, self.eps)
                k = l2_norm(k, self.head_size, self.eps)
        elif self.temperature_tuning:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            scale = scale * self.attn_scale + 1.0
            q = (q.view(q.size(0), -1, self.head_size) * scale[:, None, None]).view_as(q)
            q = q.to(v.dtype)
        return self.o_proj(self.attn(q, k, v))


class Llama4MoE(nn.Module):
    """Routed experts (sigmoid weights applied to their inputs) plus the shared expert."""

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_local_experts
        self.router = ReplicatedLinear(hidden, num_experts, False, ctx, f"{prefix}.router")
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, hidden,
                                config.intermediate_size, False, ctx, scoring="sigmoid",
                                apply_router_weight_on_input=True)
        self.shared_expert = LlamaMLP(config, ctx, f"{prefix}.shared_expert",
                                      config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x) + self.experts(x, self.router(x))


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention

    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        if layer_idx in config.moe_layers:
            return Llama4MoE(config, ctx, prefix)
        return LlamaMLP(config, ctx, prefix, config.intermediate_size_mlp)


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer


class Llama4ForCausalLM(MoeForCausalLM):
    model_cls = Llama4Model
    checkpoint_renames = {".feed_forward.": ".mlp."}
    stacked_experts_transposed = True
