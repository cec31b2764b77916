"""FlashAttention 2 (`flash_attn`) over the paged cache: one call per layer and step.

`flash_attn_varlen_func` takes the block table directly (paged KV), handles prefill chunks and
decodes in one call (causal masks align to the end of each sequence) and GQA natively. A step of
decodes only goes through `flash_attn_with_kvcache` instead, which splits long contexts across
thread blocks (flash-decoding) when the batch alone would leave the GPU idle. Upstream
FlashAttention 2 needs the cache's block size to be a multiple of 256 for paged KV, half-precision
inputs and compute capability 8.0+; the CUDA platform checks all three before offering it.
The step's K/V are written with the Triton cache kernel, which skips padding slots, so decode
steps can be recorded as CUDA graphs (the host-side `max_seq_len` is then the model's limit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

PAGE_MULTIPLE = 256


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    graph_capturable = True

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if dtype not in (torch.float16, torch.bfloat16):
            return False, f"needs float16 or bfloat16, the model runs {dtype}"
        if kv_cache_dtype != dtype:
            return False, f"KV-cache dtype {kv_cache_dtype} differs from the model's {dtype}"
        if head_size > 256 or head_size % 8:
            return False, f"head size {head_size} is not a multiple of 8 up to 256"
        return True, ""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from runtime.attention_backends.triton_ops import write_kv
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, -1)
        if metadata.max_query_len == 1:  # decodes only: the kernel that splits long contexts
            return flash_attn_with_kvcache(
                query.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.seq_lens,
                block_table=metadata.block_tables, softmax_scale=self.scale, causal=True,
                window_size=window).squeeze(1)
        cu_seqlens_k = F.pad(metadata.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            query, k_cache, v_cache, cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len, softmax_scale=self.scale, causal=True,
            window_size=window, block_table=metadata.block_tables)
