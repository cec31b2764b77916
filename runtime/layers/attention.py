"""The attention layer: hands Q, K, V and this step's metadata to the chosen backend; and the
zeroing of KV-cache blocks on first use."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
        # set by the worker for --calculate-kv-scales: the next forward sets the FP8 scales
        self.calculate_kv_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        t = q.size(0)
        if self.calculate_kv_scales:
            self.impl.calculate_kv_scales(k, v)
            self.calculate_kv_scales = False
        out = self.impl.forward(q.view(t, self.num_heads, self.head_size),
                                k.view(t, self.num_kv_heads, self.head_size),
                                v.view(t, self.num_kv_heads, self.head_size),
                                self.kv_cache, get_forward_context())
        return out.reshape(t, self.num_heads * self.head_size)


def zero_new_blocks(kv_layers: list[Attention], reqs: Iterable[Any], num_zeroed: int) -> int:
    """Zero the blocks `reqs` (a step's requests, each with its `block_ids`) reach beyond the
    first `num_zeroed` of every layer's cache; returns the new count. The block pool hands out
    never-used blocks in increasing id order."""
    top = max(max(r.block_ids) for r in reqs) + 1
    if top <= num_zeroed:
        return num_zeroed
    for layer in kv_layers:
        layer.kv_cache.narrow(layer.impl.kv_cache_block_dim, num_zeroed, top - num_zeroed).zero_()
    return top
