"""FlashInfer's batch prefill kernel over the paged cache (decodes are one-token prefills).

FlashInfer plans a batch on the host (`plan`) and then runs every layer against that plan, so
the plan is made once per step, by the first layer that sees the step's metadata, and shared by
all layers through a module-level wrapper. The cache halves are used in FlashInfer's "NHD"
layout, [num_blocks, block_size, num_kv_heads, head_size], which is the base layout's.
Planning reads host lists, so decode steps are not recorded as graphs with this backend.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 << 20


class _Plan:
    """The wrapper of this process and the step metadata it was last planned for."""

    wrapper: Any = None
    metadata: AttentionMetadata | None = None


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if dtype not in (torch.float16, torch.bfloat16):
            return False, f"needs float16 or bfloat16, the model runs {dtype}"
        if kv_cache_dtype != dtype:
            return False, f"KV-cache dtype {kv_cache_dtype} differs from the model's {dtype}"
        if head_size not in (64, 128, 256):
            return False, f"head size {head_size} is not 64, 128 or 256"
        return True, ""

    def _plan(self, metadata: AttentionMetadata, k_cache: torch.Tensor,
              dtype: torch.dtype) -> Any:
        import flashinfer
        if _Plan.wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=k_cache.device)
            _Plan.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if _Plan.metadata is not metadata:
            block_size = k_cache.size(1)
            blocks = [-(-n // block_size) for n in metadata.seq_lens_cpu]
            indptr = torch.tensor([0] + blocks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            tables = metadata.block_tables
            indices = torch.cat([tables[i, :n] for i, n in enumerate(blocks)])
            last = torch.tensor([n - (b - 1) * block_size for n, b in
                                 zip(metadata.seq_lens_cpu, blocks)], dtype=torch.int32)
            _Plan.wrapper.plan(
                metadata.query_start_loc, indptr.to(k_cache.device), indices,
                last.to(k_cache.device), self.num_heads, self.num_kv_heads, self.head_size,
                block_size, causal=True, sm_scale=self.scale,
                window_left=self.sliding_window - 1 if self.sliding_window else -1,
                q_data_type=dtype, kv_data_type=k_cache.dtype)
            _Plan.metadata = metadata
        return _Plan.wrapper

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(flat_v.dtype))
        wrapper = self._plan(metadata, k_cache, query.dtype)
        return wrapper.run(query.contiguous(), (k_cache, v_cache))
