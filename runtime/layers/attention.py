"""The attention layer: hands Q, K, V and this step's metadata to the chosen backend; and the
paged KV cache of a model's attention layers (MLA layers' latent caches too)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.layers.build_context import BuildContext
from runtime.layers.mla_attention import MLAAttention


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


class PagedKVCache:
    """The KV cache of one model's attention layers: one tensor per layer, in the layout its
    backend asks for, addressed by the engine's block ids.

    The memory is not touched when allocated: zeroing gigabytes up front costs seconds of page
    faults. Blocks are zeroed when a step first reaches them (`zero_new_blocks`; the block pool
    hands out never-used blocks in increasing id order), so attention never reads uninitialised
    memory past a sequence's end.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, (Attention, MLAAttention))]
        self.num_zeroed_blocks = 0

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all these layers, in their backends' layouts."""
        return sum(math.prod(type(layer.impl).kv_cache_shape(1, block_size, layer.num_kv_heads,
                                                             layer.head_size))
                   for layer in self.layers) * dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        for layer in self.layers:
            shape = type(layer.impl).kv_cache_shape(num_blocks, block_size, layer.num_kv_heads,
                                                    layer.head_size)
            layer.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        self.num_zeroed_blocks = 0

    def release(self) -> None:
        for layer in self.layers:
            layer.kv_cache = torch.empty(0)

    def zero_new_blocks(self, reqs: Iterable[Any]) -> None:
        """Zero the blocks `reqs` (a step's requests, each with its `block_ids`) reach beyond
        those already zeroed."""
        top = max(max(r.block_ids) for r in reqs) + 1
        if top <= self.num_zeroed_blocks:
            return
        start = self.num_zeroed_blocks
        for layer in self.layers:
            layer.kv_cache.narrow(layer.impl.kv_cache_block_dim, start, top - start).zero_()
        self.num_zeroed_blocks = top
