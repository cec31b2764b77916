"""Qwen3.5 and Qwen3.5-MoE (text): hybrids of gated delta-net layers (`linear_attention`) and
gated attention (`full_attention`, 1 layer in 4 by default), on the Llama layers.

What differs from Qwen3: the query projection also yields a per-head output gate
(attention out * sigmoid(gate)); rotary embeddings cover part of each head
(`partial_rotary_factor`); every RMSNorm scales by (1 + weight), as Gemma's. The gated
delta-nets keep their state in the recurrent state cache (runtime.layers.recurrent_state).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.gated_delta_net import GatedDeltaNet
from runtime.layers.linear import QKVParallelLinear, RowParallelLinear
from runtime.layers.rotary import get_rope, rotary_embedding
from runtime.model_config import attention_heads
from runtime.models.gemma import GemmaRMSNorm
from runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.models.moe import MoeForCausalLM, SparseMoeBlock


class Qwen3_5Attention(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        num_heads, num_kv_heads, self.head_size = attention_heads(config)
        # Each head's query is followed by its gate in q_proj: as 2 * num_heads "heads" they
        # split over tensor-parallel ranks with their gates.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_size, 2 * num_heads,
                                          num_kv_heads, config.attention_bias, ctx,
                                          f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_size, config.hidden_size,
                                        config.attention_bias, ctx, f"{prefix}.o_proj")
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, ctx)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, ctx)
        self.rotary_emb = get_rope(self.head_size,
                                   ctx.max_model_len or config.max_position_embeddings,
                                   config, ctx.dtype)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding
        self.attn = Attention(self.num_heads, self.head_size, self.head_size ** -0.5,
                              self.num_kv_heads, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.size(0)
        q_size = 2 * self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        qg, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous()).view(t, -1)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_size)).view(t, -1)
        q, k = self.rotary_op(positions, q, k, self.rotary_emb.cos_sin_cache, self.head_size)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3_5Attention

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        nn.Module.__init__(self)
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, ctx, f"{prefix}.linear_attn")
        elif self.layer_type == "full_attention":
            self.self_attn = self.attention_cls(config, layer_idx, ctx, f"{prefix}.self_attn")
        else:
            raise ValueError(f"layer {layer_idx}: layer type {self.layer_type!r}; allowed are "
                             "'linear_attention' and 'full_attention'")
        self.mlp = self.build_mlp(config, layer_idx, ctx, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.linear_attn(hidden)
        else:
            hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(LlamaModel):
    layer_cls = Qwen3_5DecoderLayer
    norm_cls = GemmaRMSNorm


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3_5Model
    is_hybrid = True
    stacked_params = {**LlamaForCausalLM.stacked_params,
                      **{name: ("in_proj", shard)
                         for name, shard in GatedDeltaNet.in_proj_shards.items()}}


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        return SparseMoeBlock(config, ctx, prefix, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, True,
                              config.shared_expert_intermediate_size)


class Qwen3_5MoeModel(Qwen3_5Model):
    layer_cls = Qwen3_5MoeDecoderLayer


class Qwen3_5MoeForCausalLM(MoeForCausalLM):
    """Qwen3.5-MoE (text): every layer's MLP is a routed MoE (top-k renormalised) with a gated
    shared expert."""

    model_cls = Qwen3_5MoeModel
    is_hybrid = True
    stacked_params = Qwen3_5ForCausalLM.stacked_params
