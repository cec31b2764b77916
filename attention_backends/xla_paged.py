"""Paged attention in shape-static torch: no host lists, no data-dependent shapes.

Every tensor's shape follows from the batch's padded sizes (tokens, requests, longest query,
and the longest context rounded up to a power of two of blocks, at most the block-table width),
so XLA compiles one graph per bucket and reuses it; the same code runs on any torch device,
which is how the tests check it on the CPU. Queries are regrouped per request into [requests,
longest query, heads, head_size], the blocks of each request's table row that the bucket covers
are gathered in the cache's dtype (scores and softmax in float32), and one masked softmax
attends. Padding tokens (slot -1) write into one scratch block
past the cache's real blocks, which no request ever reads.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

MASKED = -1e30  # finite, so rows with nothing visible (padding) stay free of NaN


class XlaPagedAttention(AttentionBackend):
    name = "xla_paged"
    graph_capturable = True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks + 1, block_size, num_kv_heads, head_size)  # + the scratch block

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size = k_cache.shape[:2]
        scratch = (num_blocks - 1) * block_size
        slots = torch.where(metadata.slot_mapping < 0, scratch, metadata.slot_mapping)
        k_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slots,
                                                                         key.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slots,
                                                                         value.to(v_cache.dtype))

        starts = metadata.query_start_loc
        q_lens = starts[1:] - starts[:-1]  # [R]
        seq_lens = metadata.seq_lens
        offsets = torch.arange(metadata.max_query_len, device=query.device)
        q_valid = offsets[None, :] < q_lens[:, None]  # [R, Q]
        tokens = torch.where(q_valid, starts[:-1, None] + offsets[None, :], 0)
        group = self.num_heads // self.num_kv_heads
        r, q = tokens.shape
        qs = query[tokens].view(r, q, self.num_kv_heads, group, self.head_size)
        tables = metadata.block_tables[:, :context_blocks(metadata.max_seq_len, block_size,
                                                          metadata.block_tables.size(1))]
        k = k_cache[tables].flatten(1, 2)  # [R, L, Hkv, D]
        v = v_cache[tables].flatten(1, 2)
        scores = torch.einsum("rqhgd,rlhd->rhgql", qs.to(k.dtype), k).float() * self.scale
        q_pos = (seq_lens - q_lens)[:, None] + offsets[None, :]  # [R, Q]
        k_pos = torch.arange(k.size(1), device=query.device)
        visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & \
                  (k_pos[None, None, :] < seq_lens[:, None, None])
        if self.sliding_window is not None:
            visible &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        scores = scores.masked_fill(~visible[:, None, None], MASKED)
        out = torch.einsum("rhgql,rlhd->rqhgd", scores.softmax(-1).to(v.dtype), v)
        out = out.reshape(r, q, self.num_heads, self.head_size).to(query.dtype)
        # back to the flat batch: token t belongs to the request whose range holds it
        t = torch.arange(query.size(0), device=query.device, dtype=starts.dtype)
        req = torch.bucketize(t, starts[1:], right=True).clamp(max=r - 1)
        return out[req, (t - starts[req]).clamp(0, q - 1)]


def context_blocks(max_seq_len: int, block_size: int, width: int) -> int:
    """Blocks of each table row to gather: the longest context's, rounded up to a power of two
    (one compiled graph per bucket), at most the table's width."""
    return min(width, 1 << max(0, -(-max_seq_len // block_size) - 1).bit_length())
