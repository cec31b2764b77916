"""torch_xla's ragged paged attention (a Pallas TPU kernel) over a combined K/V cache.

The kernel takes the flat batch as it is (cumulative query lengths, sequence lengths, block
tables), prefill chunks and decodes together. Its cache keeps K and V interleaved along the head
dimension, [num_blocks, block_size, 2 * num_kv_heads, head_size], so this backend declares that
layout (blocks on dimension 0), plus one scratch block past the real ones that padding tokens
(slot -1) write into and no request reads.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata


class PallasRaggedAttention(AttentionBackend):
    name = "pallas_ragged"
    kv_cache_block_dim = 0
    graph_capturable = True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (num_blocks + 1, block_size, 2 * num_kv_heads, head_size)

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if head_size % 128:
            return False, f"head size {head_size} is not a multiple of 128 (TPU lanes)"
        if kv_cache_dtype != dtype:
            return False, f"KV-cache dtype {kv_cache_dtype} differs from the model's {dtype}"
        return True, ""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        from torch_xla.experimental.custom_kernel import ragged_paged_attention
        num_blocks, block_size = kv_cache.shape[:2]
        scratch = (num_blocks - 1) * block_size
        slots = torch.where(metadata.slot_mapping < 0, scratch, metadata.slot_mapping)
        kv = torch.stack([key, value], dim=2).flatten(1, 2)  # heads k0, v0, k1, v1 …
        kv_cache.flatten(0, 1).index_copy_(0, slots, kv.to(kv_cache.dtype))
        starts = metadata.query_start_loc
        num_seqs = (starts[1:] > starts[:-1]).sum().reshape(1).to(torch.int32)  # padding last
        return ragged_paged_attention(query, kv_cache, metadata.seq_lens, metadata.block_tables,
                                      starts, num_seqs, sm_scale=self.scale,
                                      sliding_window=self.sliding_window)
