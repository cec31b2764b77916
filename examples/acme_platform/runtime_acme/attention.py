"""acme's attention backend: paged attention request by request, scores in float32."""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata


class AcmePagedAttention(AttentionBackend):
    name = "acme_paged"
    supports_logits_soft_cap = True

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if kv_cache_dtype != dtype:
            return False, f"keeps the KV cache in the model dtype only, not {kv_cache_dtype}"
        return True, ""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        block_size = kv_cache.size(2)
        k_cache, v_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        k_cache[metadata.slot_mapping] = key  # slots < 0 never occur: acme records no graphs
        v_cache[metadata.slot_mapping] = value
        kv_head = torch.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu[:metadata.num_reqs]):
            blocks = metadata.block_tables[i, :-(-seq_len // block_size)].long()
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
            k = k_cache[slots][:, kv_head].float()  # [seq_len, heads, head_size]
            v = v_cache[slots][:, kv_head].float()
            q = query[starts[i]:starts[i + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if self.logits_soft_cap is not None:
                scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
            q_pos = torch.arange(seq_len - q.size(0), seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        return out
