"""acme's attention backend: paged attention request by request, scores in float32."""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata


class AcmePagedAttention(AttentionBackend):
    name = "acme_paged"
    supports_logits_soft_cap = True
    supports_attention_sinks = True

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if device_type != "cpu":
            return False, f"computes on the host (device type 'cpu'), not {device_type!r}"
        return True, ""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_cache(key, value, kv_cache, metadata)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q = query[starts[i]:starts[i + 1]]
            k, v = self.context(kv_cache, metadata, i)
            q_pos = torch.arange(seq_len - q.size(0), seq_len)
            out[starts[i]:starts[i + 1]] = self.attend(q, k, v, q_pos).to(out.dtype)
        return out

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata) -> None:
        """The step's K and V into their slots (slots < 0 never occur: acme records no graphs)."""
        kv_cache[0].flatten(0, 1)[metadata.slot_mapping] = key
        kv_cache[1].flatten(0, 1)[metadata.slot_mapping] = value

    def context(self, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request `request`'s K and V, [seq_len, num_kv_heads, head_size], read through its
        block table."""
        block_size, seq_len = kv_cache.size(2), metadata.seq_lens_cpu[request]
        blocks = metadata.block_tables[request, :-(-seq_len // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
        return kv_cache[0].flatten(0, 1)[slots], kv_cache[1].flatten(0, 1)[slots]

    def kv_head_of(self) -> torch.Tensor:
        """The KV head each query head reads: consecutive groups of query heads share one."""
        return torch.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_pos: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries at positions `q_pos` over keys at 0 .. len(k) - 1."""
        heads = self.kv_head_of()
        return self.softmax_attention(q, k[:, heads], v[:, heads], self.mask(q_pos, k.size(0)))

    def mask(self, q_pos: torch.Tensor, length: int) -> torch.Tensor:
        """[queries, keys]: causal; the window holds the query's own position and the
        `sliding_window - 1` before it."""
        k_pos = torch.arange(length)[None, :]
        mask = k_pos <= q_pos[:, None]
        if self.sliding_window is not None:
            mask &= k_pos > q_pos[:, None] - self.sliding_window
        return mask

    def softmax_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """Scores, softmax and P·V in float32, whatever the input dtype; a head's sink logit is
        one more column of its softmax, with no value."""
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = self.sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, v.float())
