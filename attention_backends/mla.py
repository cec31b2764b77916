"""Portable multi-head latent attention in plain torch: runs on any device torch runs on.

Prefill chunks decompress their request's whole context from the cached latents through
`kv_b_proj` and run `scaled_dot_product_attention` per request (a long prompt's K/V are
computed once, as transformers does). Decodes run absorbed (see `MLAAttentionBackend`): the
queries move into the latent space, attend over the gathered latents as one shared KV head,
and come back through W_UV; the latent attention is `decode_latent`, which the CPU and Triton
backends replace with kernels that read the cache blocks directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionMetadata, MLAAttentionBackend


def latent_attention(q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor,
                     kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Reference latent attention: q [B, H, L + R] over latents [B, S, L + R] (keys: the whole
    vector; values: its first `kv_lora_rank`), keys where `mask` [B, S] is set, scores and
    softmax in float32. Returns [B, H, kv_lora_rank] in q's dtype."""
    scores = torch.matmul(q.float(), latents.float().transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, -1)
    return torch.matmul(probs, latents[..., :kv_lora_rank].float()).to(q.dtype)


class TorchMLAAttention(MLAAttentionBackend):
    name = "torch_mla"

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        latents = torch.cat((kv_c, k_pe), -1)
        if latents.size(0):
            kv_cache.view(-1, self.head_size).index_copy_(0, metadata.slot_mapping,
                                                          latents.to(kv_cache.dtype))
        out = q_nope.new_empty(q_nope.size(0), self.num_heads, self.v_head_dim)
        nd = metadata.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, metadata, nd)
        starts = metadata.query_start_loc_cpu
        block_size = kv_cache.size(1)
        for i in range(nd, metadata.num_reqs):
            lo, hi = starts[i], starts[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            if hi - lo == seq_len:
                context = latents[lo:hi]  # the whole context is new
            else:
                blocks = metadata.block_tables[i, :-(-seq_len // block_size)]
                context = kv_cache[blocks].flatten(0, 1)[:seq_len].to(q_nope.dtype)
            out[lo:hi] = self._prefill(q_nope[lo:hi], q_pe[lo:hi], context)
        return out

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                 context: torch.Tensor) -> torch.Tensor:
        """The new tokens' attention over `context` [S, L + R] (their own latents last), with
        K and V decompressed per head."""
        seq_len, q_len = context.size(0), q_nope.size(0)
        kv = F.linear(context[:, :self.kv_lora_rank], self.kv_b_weight)
        kv = kv.view(seq_len, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], -1)
        k_pe = context[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
        q = torch.cat((q_nope, q_pe), -1).transpose(0, 1)
        k = torch.cat((k_nope, k_pe), -1).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=mask,
                                           scale=self.scale)
        return o.transpose(0, 1)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, nd: int) -> torch.Tensor:
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [nd, H, L]
        q = torch.cat((q_latent, q_pe), -1)
        o_latent = self.decode_latent(q, kv_cache, metadata.block_tables[:nd],
                                      metadata.seq_lens[:nd], metadata.seq_lens_cpu[:nd])
        return torch.bmm(o_latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def decode_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> torch.Tensor:
        """One query per sequence, q [B, H, L + R], over its cached latents: [B, H, L]."""
        block_size = kv_cache.size(1)
        num_blocks = -(-max(seq_lens_cpu) // block_size)
        latents = kv_cache[block_tables[:, :num_blocks]].flatten(1, 2)  # [B, S, L + R]
        mask = torch.arange(latents.size(1), device=q.device)[None, :] < seq_lens[:, None]
        return latent_attention(q, latents, mask, self.kv_lora_rank, self.scale)
