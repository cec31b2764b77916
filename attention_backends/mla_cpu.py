"""Multi-head latent attention for the CPU with a native absorbed-decode kernel.

Decodes run `torch.ops.runtime_cpu.mla_decode` (platforms/cpu/csrc/mla_attention.cpp): each
cached latent row is read once per group of heads, straight from its block, instead of the
portable path's gather of every sequence's context into a padded tensor. Prefill chunks and
the absorption GEMMs around the kernel are the portable backend's.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.cpu_paged import cpu_kernel_supports
from runtime.attention_backends.mla import TorchMLAAttention


class CpuMLAAttention(TorchMLAAttention):
    name = "cpu_mla"

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        return cpu_kernel_supports(cls, "latent width", head_size, dtype, kv_cache_dtype,
                                   device_type)

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 kv_b_weight: torch.Tensor) -> None:
        if kv_lora_rank % 8:
            raise ValueError(f"cpu_mla needs kv_lora_rank a multiple of 8, got {kv_lora_rank}")
        super().__init__(num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, scale, kv_b_weight)

    def decode_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> torch.Tensor:
        out = q.new_empty(q.size(0), q.size(1), self.kv_lora_rank)
        torch.ops.runtime_cpu.mla_decode(out, q.contiguous(), kv_cache, block_tables, seq_lens,
                                         self.scale)
        return out
