"""FlashInfer's batch prefill kernel over the paged cache (decodes are one-token prefills).

FlashInfer plans a batch on the host (`plan`) and then runs layers against that plan. The plan
also fixes the layer's scale, sliding window and soft-cap, so there is one plan per step for
each distinct set of those (`FlashInferBackend.plan_key`), made by the first layer of the set
that sees the step's metadata. The cache halves are used in FlashInfer's "NHD" layout,
[num_blocks, block_size, num_kv_heads, head_size], which is the base layout's. Planning reads
host lists, so decode steps are not recorded as graphs with this backend (the CUDA platform
ranks it below triton_paged unless execution is eager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 << 20


@dataclass
class _Plan:
    """One wrapper and the step metadata it was last planned for."""

    wrapper: Any
    metadata: AttentionMetadata | None = None


# A plan fixes what the layer brings (heads, head size, scale, window, soft-cap, dtypes), so
# layers share a plan only when all of these agree: a model mixing sliding-window and global
# layers (Gemma 2/3, some Mistrals) plans twice per step. The wrappers run one after another on
# the device's stream, so they share one float workspace per device.
_PLANS: dict[tuple, _Plan] = {}
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


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

    # The tanh cap on attention scores of models that use one (Gemma 2), per layer; None: none.
    logits_soft_cap: float | None = None

    @property
    def window_left(self) -> int:
        """FlashInfer's window: how many earlier positions a token sees (-1: all)."""
        return self.sliding_window - 1 if self.sliding_window else -1

    def plan_key(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple:
        """What this layer's plan depends on besides the step's metadata."""
        return (self.num_heads, self.num_kv_heads, self.head_size, self.window_left, self.scale,
                self.logits_soft_cap, q_dtype, kv_dtype)

    def _plan(self, metadata: AttentionMetadata, k_cache: torch.Tensor,
              dtype: torch.dtype) -> Any:
        import flashinfer
        key = self.plan_key(dtype, k_cache.dtype)
        plan = _PLANS.get(key)
        if plan is None:
            device = k_cache.device
            if device not in _WORKSPACES:
                _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                  device=device)
            plan = _PLANS[key] = _Plan(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _WORKSPACES[device], "NHD"))
        if plan.metadata is not metadata:
            block_size = k_cache.size(1)
            blocks = [-(-n // block_size) for n in metadata.seq_lens_cpu]
            indptr = torch.tensor([0] + blocks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            tables = metadata.block_tables
            indices = torch.cat([tables[i, :n] for i, n in enumerate(blocks)])
            last = torch.tensor([n - (b - 1) * block_size for n, b in
                                 zip(metadata.seq_lens_cpu, blocks)], dtype=torch.int32)
            plan.wrapper.plan(
                metadata.query_start_loc, indptr.to(k_cache.device), indices,
                last.to(k_cache.device), self.num_heads, self.num_kv_heads, self.head_size,
                block_size, causal=True, sm_scale=self.scale, window_left=self.window_left,
                logits_soft_cap=self.logits_soft_cap, q_data_type=dtype,
                kv_data_type=k_cache.dtype)
            plan.metadata = metadata
        return plan.wrapper

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(flat_v.dtype))
        wrapper = self._plan(metadata, k_cache, query.dtype)
        return wrapper.run(query.contiguous(), (k_cache, v_cache))
