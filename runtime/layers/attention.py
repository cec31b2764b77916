"""The attention layer: hands Q, K, V and this step's metadata to the chosen backend."""
from __future__ import annotations

import torch
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 ctx: BuildContext, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window
        self.impl = ctx.attention_backend(num_heads, head_size, scale, num_kv_heads,
                                          sliding_window, logits_soft_cap)
        self.kv_cache = torch.empty(0)  # bound by the model runner once the cache is allocated

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        t = q.size(0)
        out = self.impl.forward(q.view(t, self.num_heads, self.head_size),
                                k.view(t, self.num_kv_heads, self.head_size),
                                v.view(t, self.num_kv_heads, self.head_size),
                                self.kv_cache, get_forward_context())
        return out.reshape(t, self.num_heads * self.head_size)
