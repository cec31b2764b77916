"""Multi-head latent attention with an absorbed-decode kernel in Triton (NVIDIA, AMD, Intel GPUs).

The decode kernel's grid is (sequence, head tile): each program takes BLOCK_H heads of one
sequence (their queries in the latent space, [kv_lora_rank | rope]) and walks the sequence's
cached latents through the block table BLOCK_N positions at a time with an online softmax.
All heads share each latent row, so a tile of rows is loaded once for BLOCK_H heads and
serves as keys (the whole row) and values (its first kv_lora_rank). The latent and rope parts
are padded to powers of two separately, so DeepSeek's 512 + 64 needs no 1024-wide tile.
Prefill chunks and the absorption GEMMs are the portable backend's. With TRITON_INTERPRET=1
(set before Triton is imported) the kernel runs on the CPU, which is how the tests check it.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.mla import TorchMLAAttention

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonMLAAttention(TorchMLAAttention):
    name = "triton_mla"

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
                 sliding_window: int | None, device_type: str) -> tuple[bool, str]:
        if dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {dtype} is not one of float16, bfloat16, float32"
        return cls.supports_kv_cache_dtype(dtype, kv_cache_dtype)

    def decode_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> torch.Tensor:
        return mla_decode(q, kv_cache, block_tables, seq_lens, self.kv_lora_rank, self.scale)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """q [B, H, L + R] over the cache [num_blocks, block_size, L + R]: [B, H, L]."""
    import triton
    from runtime.attention_backends.mla_triton_kernel import mla_decode_kernel
    num_seqs, num_heads, width = q.shape
    rope = width - kv_lora_rank
    out = q.new_empty(num_seqs, num_heads, kv_lora_rank)
    block_h = min(max(triton.next_power_of_2(num_heads), 16), 64)
    grid = (num_seqs, triton.cdiv(num_heads, block_h))
    mla_decode_kernel[grid](
        q, kv_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, kv_cache.size(1), kv_lora_rank, rope,
        BLOCK_H=block_h, BLOCK_N=16, BLOCK_L=max(triton.next_power_of_2(kv_lora_rank), 16),
        BLOCK_R=max(triton.next_power_of_2(rope), 16),
        # float32 stays float32 (no TF32), as the portable reference computes it
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None)
    return out
