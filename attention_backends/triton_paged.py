"""Our own paged attention in Triton: mixed prefill/decode batches over the block table.

It runs wherever Triton compiles (NVIDIA, AMD, Intel GPUs), so accelerator platforms offer it
as the backend that is always there. It reads nothing per step on the host beyond the batch's
request count and longest query, so decode steps can be recorded as device graphs. The kernels
live in `runtime.attention_backends.triton_ops`, imported on the first forward pass so that choosing
this backend never needs Triton to be importable. The cache may be FP8 (e4m3 or e5m2) on any GPU:
the kernels encode and decode its bytes themselves. Attention sinks (gpt-oss) start each
row's online softmax.

Decode context parallel (`forward_with_lse`): the kernels attend each request over this rank's
shard, masked at the keys' real positions, and return each row's log-sum-exp; this reads the
host no more than `forward` does. Sinks are refused there (each rank's softmax would count
them; the engine refuses them with DCP too). Checked on the CPU through Triton's interpreter
only, not yet on a GPU.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonPagedAttention(AttentionBackend):
    name = "triton_paged"
    graph_capturable = True
    fp8_kv_cache = True
    can_return_lse = True
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
        out = torch.empty_like(query)
        self._attend(out, None, query, key, value, kv_cache, metadata)
        return out

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor,
                         metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sinks is not None:
            raise ValueError("triton_paged does not merge attention sinks over decode context "
                             "parallel ranks: each rank's partial softmax would count them")
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        self._attend(out, lse, query, key, value, kv_cache, metadata)
        return out, lse

    def _attend(self, out: torch.Tensor, lse: torch.Tensor | None, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> None:
        """Write the step's K/V (slots < 0 are skipped: padding, or other DCP ranks' tokens),
        then attend into `out` (and the log-sum-exp into `lse`, when given)."""
        from runtime.attention_backends.triton_ops import paged_attention, write_kv
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        paged_attention(out, query, k_cache, v_cache, metadata, self.scale, self.sliding_window,
                        self.k_scale, self.v_scale, self.sinks, self.attention_chunk_size,
                        metadata.dcp, lse)
