"""The multi-head latent attention (MLA) layer: hands this step's queries and latents to the
chosen MLA backend, which keeps one latent vector per token in the paged cache."""
from __future__ import annotations

import torch
from torch import nn

from runtime.forward_context import get_forward_context, get_kv_connector
from runtime.layers.build_context import BuildContext


class MLAAttention(nn.Module):
    """`kv_b_weight` is this rank's `kv_b_proj` weight (see `MLAAttentionBackend`)."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 kv_b_weight: torch.Tensor, ctx: BuildContext) -> None:
        super().__init__()
        if getattr(ctx.attention_backend, "kind", "mha") != "mla":
            raise ValueError(f"attention backend {ctx.attention_backend.name} runs K/V "
                             f"attention; this model's layers need an MLA backend")
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        # what the paged cache sizes the layer by: one latent "head" per token
        self.num_kv_heads, self.head_size = 1, kv_lora_rank + qk_rope_head_dim
        self.impl = ctx.attention_backend(num_heads, kv_lora_rank, qk_nope_head_dim,
                                          qk_rope_head_dim, v_head_dim, scale, kv_b_weight)
        self.kv_cache = torch.empty(0)  # bound by the model runner once the cache is allocated
        self.kv_layer_name = ""  # its cache's name for a KV connector, set by PagedKVCache
        self.calculate_kv_scales = False  # an MLA cache is never FP8: nothing to calculate

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), kv_c [T, kv_lora_rank]
        (normalised), k_pe [T, rope] (rotated) -> [T, H * v_head_dim]."""
        metadata, connector = get_forward_context(), get_kv_connector()
        if connector is not None:
            connector.wait_for_layer_load(self.kv_layer_name)
        out = self.impl.forward(q_nope, q_pe, kv_c, k_pe, self.kv_cache, metadata)
        if connector is not None:
            connector.save_kv_layer(self.kv_layer_name, metadata)
        return out.reshape(q_nope.size(0), self.num_heads * self.v_head_dim)
