"""Our own paged attention in Triton: mixed prefill/decode batches over the block table.

It runs wherever Triton compiles (NVIDIA, AMD, Intel GPUs), so accelerator platforms offer it
as the backend that is always there. It reads nothing per step on the host beyond the batch's
request count and longest query, so decode steps can be recorded as device graphs. The kernels
live in `runtime.attention_backends.triton_ops`, imported on the first forward pass so that choosing
this backend never needs Triton to be importable. The cache may be FP8 (e4m3 or e5m2) on any GPU:
the kernels encode and decode its bytes themselves. Attention sinks (gpt-oss) start each
row's online softmax.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonPagedAttention(AttentionBackend):
    name = "triton_paged"
    graph_capturable = True
    fp8_kv_cache = True
    supports_attention_sinks = True
    supports_chunked_attention = True

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {dtype} is not one of float16, bfloat16, float32"
        if head_size > 256:
            return False, f"head size {head_size} is above 256"
        return cls.supports_kv_cache_dtype(dtype, kv_cache_dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        from runtime.attention_backends.triton_ops import paged_attention, write_kv
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty_like(query)
        paged_attention(out, query, k_cache, v_cache, metadata, self.scale, self.sliding_window,
                        self.k_scale, self.v_scale, self.sinks, self.attention_chunk_size)
        return out
