"""Intel Extension for PyTorch's paged attention (XPU): one varlen call per layer and step.

`ipex.llm.modules.PagedAttention` writes the step's K/V (`reshape_and_cache_flash`) and attends
over the block table (`flash_attn_varlen_func`), prefill chunks and decodes alike, in the base
cache layout's halves, [num_blocks, block_size, num_kv_heads, head_size].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata


class IpexPagedAttention(AttentionBackend):
    name = "ipex_paged"

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if dtype not in (torch.float16, torch.bfloat16):
            return False, f"needs float16 or bfloat16, the model runs {dtype}"
        if kv_cache_dtype != dtype:
            return False, f"KV-cache dtype {kv_cache_dtype} differs from the model's {dtype}"
        if sliding_window is not None:
            return False, "sliding-window attention is not wired to IPEX"
        return True, ""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        import intel_extension_for_pytorch as ipex
        ops = ipex.llm.modules.PagedAttention
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        ops.reshape_and_cache_flash(key, value, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        cu_seqlens_k = F.pad(metadata.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        ops.flash_attn_varlen_func(out, query.contiguous(), k_cache, v_cache,
                                   metadata.query_start_loc, cu_seqlens_k,
                                   metadata.max_query_len, metadata.max_seq_len, self.scale,
                                   True, metadata.block_tables, None)
        return out
