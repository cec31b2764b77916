"""FlashInfer over the paged cache: its batch decode kernel for the decodes of a step, its batch
prefill kernel for the prefill chunks.

FlashInfer plans a batch on the host (`plan`) and then runs layers against that plan. The plan
also fixes the layer's scale, sliding window and soft-cap, so there is one plan per step, kind
of kernel (decode, prefill) and distinct set of those (`FlashInferBackend.plan_key`), made by
the first layer of the set that sees the step's metadata. Plans are built from the metadata's
host lists (sequence lengths, query starts) with vectorized torch on the host; only the block
ids are gathered on the device, so planning never waits for the device. The cache halves are
used in FlashInfer's "NHD" layout, [num_blocks, block_size, num_kv_heads, head_size], which is
the base layout's. Planning reads host lists, so decode steps are not recorded as graphs with
this backend (the CUDA platform ranks it below triton_paged unless execution is eager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 << 20


@dataclass
class _Plan:
    """One wrapper (decode or prefill) and the step metadata it was last planned for."""

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

    def _plan(self, kind: str, metadata: AttentionMetadata, k_cache: torch.Tensor,
              dtype: torch.dtype) -> Any:
        """The step's wrapper of `kind` ("decode": requests [0, num_decode_tokens), one token
        each; "prefill": the rest), planned for this step's metadata."""
        import flashinfer
        key = (kind, *self.plan_key(dtype, k_cache.dtype))
        plan = _PLANS.get(key)
        if plan is None:
            device = k_cache.device
            if device not in _WORKSPACES:
                _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                  device=device)
            if kind == "decode":  # tensor cores pay off for large GQA groups (vLLM's rule)
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    _WORKSPACES[device], "NHD",
                    use_tensor_cores=self.num_heads // self.num_kv_heads > 4)
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_WORKSPACES[device],
                                                                         "NHD")
            plan = _PLANS[key] = _Plan(wrapper)
        if plan.metadata is not metadata:
            nd = metadata.num_decode_tokens
            first, last = (0, nd) if kind == "decode" else (nd, metadata.num_reqs)
            block_size = k_cache.size(1)
            indptr, indices, last_len = paged_layout(metadata, first, last, block_size)
            common = dict(window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
                          q_data_type=dtype, kv_data_type=k_cache.dtype, sm_scale=self.scale)
            if kind == "decode":
                plan.wrapper.plan(indptr, indices, last_len, self.num_heads, self.num_kv_heads,
                                  self.head_size, block_size, **common)
            else:
                starts = metadata.query_start_loc_cpu[first:last + 1]
                qo_indptr = torch.tensor(starts, dtype=torch.int32) - starts[0]
                plan.wrapper.plan(qo_indptr, indptr, indices, last_len, self.num_heads,
                                  self.num_kv_heads, self.head_size, block_size, causal=True,
                                  **common)
            plan.metadata = metadata
        return plan.wrapper

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_size)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(flat_v.dtype))
        nd = metadata.num_decode_tokens
        if nd == query.size(0):
            return self._plan("decode", metadata, k_cache, query.dtype).run(
                query.contiguous(), (k_cache, v_cache))
        prefill = self._plan("prefill", metadata, k_cache, query.dtype)
        if nd == 0:
            return prefill.run(query.contiguous(), (k_cache, v_cache))
        out = torch.empty_like(query)
        out[:nd] = self._plan("decode", metadata, k_cache, query.dtype).run(
            query[:nd].contiguous(), (k_cache, v_cache))
        out[nd:] = prefill.run(query[nd:].contiguous(), (k_cache, v_cache))
        return out


def paged_layout(metadata: AttentionMetadata, first: int, last: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page layout of requests [first, last): (kv_indptr, last_page_len) as host
    tensors, from the host lists, and kv_indices, the block ids in use, gathered from the
    device's block table with host-built positions (no device-to-host copy, no per-request
    launches)."""
    seq_lens = torch.tensor(metadata.seq_lens_cpu[first:last], dtype=torch.int32)
    blocks = (seq_lens + block_size - 1) // block_size
    indptr = F.pad(blocks.cumsum(0, dtype=torch.int32), (1, 0))
    last_len = seq_lens - (blocks - 1) * block_size
    tables = metadata.block_tables
    columns = torch.arange(tables.size(1))
    rows = torch.arange(first, last).unsqueeze(1)
    positions = (rows * tables.size(1) + columns)[columns < blocks.unsqueeze(1)]
    indices = tables.flatten()[positions.to(tables.device, non_blocking=True)]
    return indptr, indices, last_len
