"""Portable paged attention in plain torch: runs on any device torch runs on.

Decodes (one new token each) are batched into one masked attention over their gathered context;
prefill chunks run one request at a time through `scaled_dot_product_attention`. An FP8 cache
(see `base`) is written as `x / scale` saturated to the format's range and read back as
`stored * scale` in the query's dtype; prefill chunks then read their own new K/V back from the
cache too, so every token sees the same rounded values whichever step wrote them.

Under decode context parallel (`forward_with_lse`) every request attends over this rank's
shard of its context, read back from the cache and masked at the shard's real positions, and
returns its log-sum-exp with the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata, is_fp8
from runtime.attention_backends.context_parallel import ContextParallel


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` in the FP8 `dtype`, saturated to its largest finite value (round to nearest
    even)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def write_kv(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
             scale: torch.Tensor) -> None:
    """Store `x` [T, Hkv, D] at `slots` of a [num_slots, Hkv, D] cache, quantizing for FP8."""
    if not is_fp8(flat_cache.dtype):
        flat_cache.index_copy_(0, slots, x.to(flat_cache.dtype))
        return
    # torch has no FP8 index_copy_ on every device; the bytes are the same
    flat_cache.view(torch.uint8).index_copy_(
        0, slots, quantize_kv(x, scale, flat_cache.dtype).view(torch.uint8))


def read_kv(cached: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in `dtype`, dequantized when the cache is FP8."""
    if not is_fp8(cached.dtype):
        return cached.to(dtype)
    return (cached.float() * scale).to(dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None, soft_cap: float | None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [..., H, Lq, D] over k, v [..., Hkv, L, D] under a boolean `mask`
    (None: causal, Lq == L). With `soft_cap`, the scores are capped as `cap * tanh(s / cap)`
    before the softmax; with `sinks` [H], head h's sink logit joins its softmax as one more
    column with no value. scaled_dot_product_attention can do neither."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    group = q.size(-3) // k.size(-3)
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    # scores in float32, as a fused kernel keeps them: rounded to bf16 they are 6x as far off
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor, soft_cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` under a boolean `mask`, with each row's log-sum-exp of its (capped) scores
    [..., H, Lq] in float32; a row that sees no key gets output 0 and LSE -inf."""
    group = q.size(-3) // k.size(-3)
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return torch.matmul(weights.to(v.dtype), v), lse


class TorchPagedAttention(AttentionBackend):
    name = "torch_paged"
    can_return_lse = True
    fp8_kv_cache = True
    supports_logits_soft_cap = True
    supports_encoder_attention = True
    supports_attention_sinks = True
    supports_chunked_attention = True
    supports_mm_prefix = True

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
                ranges: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Which keys (positions `k_pos`) the queries at `q_pos` see, broadcast: causal or in
        the query's own range of `ranges` (an image's tokens, both ways), within the sliding
        window and within the query's chunk, where those are set."""
        mask = k_pos <= q_pos
        for lo, hi in ranges:
            mask = mask | ((q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi))
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        if self.attention_chunk_size is not None:
            mask &= k_pos >= q_pos - q_pos % self.attention_chunk_size
        return mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if metadata.prefill_only:
            return self._encode(query, key, value, metadata)
        k_cache, v_cache = self._caches(kv_cache)
        block_size = k_cache.size(1)
        self._write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

        nd = metadata.num_decode_tokens
        if 0 < nd == query.size(0):  # decodes alone: their output is the step's, no copy into one
            return self._decode(query, k_cache, v_cache, metadata, nd, block_size)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, metadata, nd, block_size)
        if nd < metadata.num_reqs:
            self._prefills(out, query, key, value, k_cache, v_cache, metadata, nd, block_size)
        return out

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor,
                         metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self._caches(kv_cache)
        kept = metadata.slot_mapping >= 0
        self._write_kv(key[kept], value[kept], k_cache, v_cache, metadata.slot_mapping[kept])
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        nd = metadata.num_decode_tokens
        if nd:
            out[:nd], lse[:nd] = self._decode_lse(query[:nd], k_cache, v_cache, metadata, nd)
        starts = metadata.query_start_loc_cpu
        for i in range(nd, metadata.num_reqs):
            q_lo, q_hi, seq_len = starts[i], starts[i + 1], metadata.seq_lens_cpu[i]
            q_pos = torch.arange(seq_len - (q_hi - q_lo), seq_len, device=query.device)
            o, l = self._attend_shard(query[q_lo:q_hi].unsqueeze(0), k_cache, v_cache,
                                      metadata.block_tables[i:i + 1], q_pos.unsqueeze(0),
                                      seq_len, metadata.dcp)
            out[q_lo:q_hi], lse[q_lo:q_hi] = o[0], l[0]
        return out, lse

    def _decode_lse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, nd: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' partial attention over this rank's shard, with LSE."""
        o, lse = self._attend_shard(q.unsqueeze(1), k_cache, v_cache, metadata.block_tables[:nd],
                                    metadata.seq_lens[:nd].unsqueeze(1) - 1,
                                    max(metadata.seq_lens_cpu[:nd]), metadata.dcp)
        return o.squeeze(1), lse.squeeze(1)

    def _attend_shard(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      tables: torch.Tensor, q_pos: torch.Tensor, max_len: int,
                      dcp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Lq, H, D] at positions `q_pos` [B, Lq] over the shard of B contexts of up to
        `max_len` tokens: the mask is taken at the shard's global positions, so causality,
        the sliding window and chunks hold exactly. Returns [B, Lq, H, D] and [B, Lq, H]."""
        block_size = k_cache.size(1)
        num_blocks = -(-max_len // (block_size * dcp.world_size))
        blocks = tables[:, :num_blocks]
        k = read_kv(k_cache[blocks].flatten(1, 2).transpose(1, 2), self.k_scale, q.dtype)
        v = read_kv(v_cache[blocks].flatten(1, 2).transpose(1, 2), self.v_scale, q.dtype)
        k_pos = dcp.positions(torch.arange(num_blocks * block_size, device=q.device))
        mask = self.visible(q_pos.unsqueeze(-1), k_pos)  # [B, Lq, L]
        o, lse = attend_lse(q.transpose(1, 2), k, v, self.scale, mask.unsqueeze(1),
                            self.logits_soft_cap)
        return o.transpose(1, 2), lse.transpose(1, 2)

    def _prefills(self, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  metadata: AttentionMetadata, nd: int, block_size: int) -> None:
        """Attention of the step's prefill chunks (requests nd.. of the batch) into `out`, one
        request at a time: a chunk whose whole context is new attends to the step's own keys,
        others to their context read back from the cache."""
        starts = metadata.query_start_loc_cpu
        all_new_ok = self.sliding_window is None and not is_fp8(k_cache.dtype)
        ranges = metadata.mm_prefix_ranges or [()] * metadata.num_reqs
        for i in range(nd, metadata.num_reqs):
            q_lo, q_hi = starts[i], starts[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            if q_hi - q_lo == seq_len and all_new_ok:
                k, v = key[q_lo:q_hi], value[q_lo:q_hi]  # the whole context is new
            else:
                blocks = metadata.block_tables[i, :-(-seq_len // block_size)]
                k = read_kv(k_cache[blocks].flatten(0, 1)[:seq_len], self.k_scale, query.dtype)
                v = read_kv(v_cache[blocks].flatten(0, 1)[:seq_len], self.v_scale, query.dtype)
            out[q_lo:q_hi] = self._prefill(query[q_lo:q_hi], k, v, seq_len, ranges[i])

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's cache as [num_blocks, block_size, num_kv_heads, head_size]
        (views: a backend that stores another layout returns it permuted)."""
        return kv_cache[0], kv_cache[1]

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's key and value [T, Hkv, D] in the caches (from `_caches`)."""
        write_kv(k_cache.view(-1, self.num_kv_heads, self.head_size), slot_mapping, key,
                 self.k_scale)
        write_kv(v_cache.view(-1, self.num_kv_heads, self.head_size), slot_mapping, value,
                 self.v_scale)

    def _encode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Prefill-only step: each request attends to its own tokens (all of them unless
        causal), with no cache. The requests are gathered into one batch padded to the
        longest (a padding slot repeats its request's last token), whose mask hides the
        padding keys."""
        lens, num_reqs, dev = metadata.seq_lens.long(), metadata.num_reqs, query.device
        width = metadata.max_seq_len
        owner = torch.repeat_interleave(torch.arange(num_reqs, device=dev), lens)
        offset = torch.arange(query.size(0), device=dev) - metadata.query_start_loc[owner]
        pos = torch.arange(width, device=dev)
        starts = metadata.query_start_loc[:-1].long().unsqueeze(1)
        source = (starts + torch.minimum(pos, lens.unsqueeze(1) - 1)).flatten()

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, h, D] -> [B, h, width, D]
            out = x.index_select(0, source)
            return out.view(num_reqs, width, *x.shape[1:]).transpose(1, 2)

        mask = (pos < lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, width]: real keys
        if metadata.causal:
            mask = mask & self.visible(pos[:, None], pos[None, :])
        elif self.sliding_window is not None:
            mask = mask & (pos[None, :] > pos[:, None] - self.sliding_window)
        o = attend(padded(query), padded(key), padded(value), self.scale, mask,
                   self.logits_soft_cap, self.sinks)
        return o.transpose(1, 2)[owner, offset]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
                 ranges: list[tuple[int, int]] = ()) -> torch.Tensor:
        q_len = q.size(0)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.to(q.dtype), v.to(q.dtype)))
        if q_len == seq_len and self.sliding_window is None and \
                self.attention_chunk_size is None and not ranges:
            o = attend(q, k, v, self.scale, None, self.logits_soft_cap, self.sinks)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            o = attend(q, k, v, self.scale, self.visible(q_pos, k_pos, ranges),
                       self.logits_soft_cap, self.sinks)
        return o.squeeze(0).transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, nd: int, block_size: int) -> torch.Tensor:
        max_len = max(metadata.seq_lens_cpu[:nd])
        num_blocks = -(-max_len // block_size)
        blocks = metadata.block_tables[:nd, :num_blocks]
        # [nd, num_blocks, block_size, Hkv, D] -> [nd, Hkv, L, D]
        k = read_kv(k_cache[blocks].flatten(1, 2).transpose(1, 2), self.k_scale, q.dtype)
        v = read_kv(v_cache[blocks].flatten(1, 2).transpose(1, 2), self.v_scale, q.dtype)
        q_pos = metadata.seq_lens[:nd].unsqueeze(1) - 1
        k_pos = torch.arange(num_blocks * block_size, device=q.device).unsqueeze(0)
        mask = self.visible(q_pos, k_pos)
        o = attend(q.unsqueeze(2), k, v, self.scale, mask[:, None, None, :],
                   self.logits_soft_cap, self.sinks)
        return o.squeeze(2)
