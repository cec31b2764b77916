"""The attention layer: hands Q, K, V and this step's metadata to the chosen backend; and the
paged KV cache of a model's attention layers (MLA layers' latent caches too)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.attention_backends.base import AttentionMetadata
from runtime.attention_backends.context_parallel import merged_weights
from runtime.forward_context import get_forward_context, get_kv_connector
from runtime.layers.build_context import BuildContext
from runtime.plugins.kv_connector import KVCacheLayer
from runtime.layers.mla_attention import MLAAttention


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 ctx: BuildContext, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, sinks: bool = False,
                 attention_chunk_size: int | None = None,
                 kv_sharing_target: str | None = None, encoder: bool = False,
                 mm_prefix: bool = True) -> None:
        """`num_heads`/`num_kv_heads` are this rank's. With `sinks`, the layer holds the
        parameter `sinks` [num_heads] float32 (gpt-oss's attention sinks; this rank's heads of
        the checkpoint's) and hands it to the backend.

        `kv_sharing_target`: the module name of an earlier layer's `Attention` whose cache
        this one reads instead of keeping its own (Gemma 4's KV-shared layers); it is handed
        that layer's K and V, and writing them again leaves the cache as it was.

        `encoder`: a vision encoder's layer, run in prefill-only steps of its own with the
        context's `encoder_attention_backend`; it keeps no KV cache.

        `mm_prefix`: whether the step's `mm_prefix_ranges` (image tokens attending both ways)
        apply to this layer; Gemma 4's global layers stay causal over images."""
        super().__init__()
        self.encoder = encoder
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window
        self.kv_sharing_target = kv_sharing_target
        self.mm_prefix = mm_prefix
        self.sinks = None
        # passed only when set: a plugin backend written before sinks and chunked attention
        # need not take them
        extra: dict[str, Any] = {}
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            first = ctx.tp_rank * num_heads
            self.sinks.weight_loader = lambda param, loaded: param.data.copy_(
                loaded[first:first + num_heads])
            extra["sinks"] = self.sinks
        if attention_chunk_size is not None:
            extra["attention_chunk_size"] = attention_chunk_size
        backend = ctx.encoder_attention_backend if encoder else ctx.attention_backend
        self.impl = backend(num_heads, head_size, scale, num_kv_heads, sliding_window,
                            logits_soft_cap, **extra)
        # decode context parallel: the group whose ranks keep shards of this layer's contexts
        self.dcp_group = None if encoder else ctx.dcp_group
        self.kv_cache = torch.empty(0)  # bound by the model runner once the cache is allocated
        self.kv_layer_name = ""  # its cache's name for a KV connector, set by PagedKVCache
        # set by the worker for --calculate-kv-scales: the next forward sets the FP8 scales
        self.calculate_kv_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        t = q.size(0)
        if self.calculate_kv_scales:
            self.impl.calculate_kv_scales(k, v)
            self.calculate_kv_scales = False
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        metadata, connector = get_forward_context(), get_kv_connector()
        if not self.mm_prefix and metadata.mm_prefix_ranges is not None:
            metadata = dataclasses.replace(metadata, mm_prefix_ranges=None)
        if connector is not None:
            connector.wait_for_layer_load(self.kv_layer_name)
        if metadata.dcp is not None and not metadata.prefill_only:
            out = self._context_parallel(q, k, v, metadata)
        else:
            out = self.impl.forward(q, k, v, self.kv_cache, metadata)
        if connector is not None and self.kv_sharing_target is None:
            connector.save_kv_layer(self.kv_layer_name, metadata)
        return out.reshape(t, self.num_heads * self.head_size)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          metadata: AttentionMetadata) -> torch.Tensor:
        """Decode context parallel: the group's ranks share these KV heads and each keeps a
        shard of every context. Every rank attends all the group's query heads over its
        shard (with LSE); the LSEs are all-gathered, each rank weights its partial outputs by
        its share, and an all-reduce sums them: this rank keeps its own heads' rows."""
        group = self.dcp_group
        heads = group.all_gather(q, dim=1)  # [T, dcp * H, D], in group-rank order
        out, lse = self.impl.forward_with_lse(heads, k, v, self.kv_cache, metadata)
        weights = merged_weights(group.all_gather(lse.unsqueeze(0), dim=0))[group.rank]
        merged = group.all_reduce(out.float() * weights.unsqueeze(-1))
        first = group.rank * self.num_heads
        return merged[:, first:first + self.num_heads].to(q.dtype)


class PagedKVCache:
    """The KV cache of one model's attention layers: one tensor per layer, in the layout its
    backend asks for, addressed by the engine's block ids.

    The memory is not touched when allocated: zeroing gigabytes up front costs seconds of page
    faults. Blocks are zeroed when a step first reaches them (`zero_new_blocks`; the block pool
    hands out never-used blocks in increasing id order), so attention never reads uninitialised
    memory past a sequence's end.
    """

    def __init__(self, model: nn.Module) -> None:
        modules = dict(model.named_modules())
        attention = [m for m in modules.values() if isinstance(m, (Attention, MLAAttention))
                     and not getattr(m, "encoder", False)]  # a vision encoder keeps no cache
        # the layers that own a cache
        self.layers = [m for m in attention if getattr(m, "kv_sharing_target", None) is None]
        # (layer, the layer whose cache it reads)
        self.shared = [(m, modules[m.kv_sharing_target]) for m in attention
                       if getattr(m, "kv_sharing_target", None) is not None]
        for i, layer in enumerate(self.layers):
            layer.kv_layer_name = f"layer.{i}"
        for layer, target in self.shared:  # it waits for the cache it reads
            layer.kv_layer_name = target.kv_layer_name
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
        for layer, target in self.shared:
            layer.kv_cache = target.kv_cache
            # the same FP8 scales, so that writing the target's K/V again stores the same bytes
            layer.impl.k_scale, layer.impl.v_scale = target.impl.k_scale, target.impl.v_scale
        self.num_zeroed_blocks = 0

    def release(self) -> None:
        for layer in self.layers + [layer for layer, _ in self.shared]:
            layer.kv_cache = torch.empty(0)

    def connector_layers(self) -> list[KVCacheLayer]:
        """The layers' caches as a KV connector addresses them."""
        return [KVCacheLayer(layer.kv_layer_name, layer.kv_cache, layer.impl.kv_cache_block_dim)
                for layer in self.layers]

    def zero_new_blocks(self, reqs: Iterable[Any]) -> None:
        """Zero the blocks `reqs` (a step's requests, each with its `block_ids`) reach beyond
        those already zeroed."""
        self.prepare_blocks([max(r.block_ids) for r in reqs])

    def prepare_blocks(self, block_ids: list[int]) -> None:
        """Zero the never-used blocks up to the highest of `block_ids` (before something other
        than attention writes into them: a KV connector's loads)."""
        if not block_ids:
            return
        top = max(block_ids) + 1
        if top <= self.num_zeroed_blocks:
            return
        start = self.num_zeroed_blocks
        for layer in self.layers:
            layer.kv_cache.narrow(layer.impl.kv_cache_block_dim, start, top - start).zero_()
        self.num_zeroed_blocks = top
