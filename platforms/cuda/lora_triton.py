"""`lora_shrink` / `lora_expand` as Triton kernels (punica's BGMV: one program per token, which
reads its own slot's matrices), for GPU platforms to answer the `runtime_custom_op` hook with.
Tested on the CPU under TRITON_INTERPRET=1 against `runtime.plugins.lora_ops`."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from runtime.plugins.lora_ops import LoRABatch


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, num_tokens, d_in, max_rank,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    s = tl.program_id(1)
    num_slices = tl.num_programs(1)
    slot = tl.load(slots_ptr + t)
    rank = tl.where(slot >= 0, max_rank, 0)  # no adapter: every mask is false
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_base = a_ptr + (slot * num_slices + s) * max_rank * d_in
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * d_in + k, mask=k < d_in, other=0.0)
        a = tl.load(a_base + r[:, None] * d_in + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < d_in), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    tl.store(out_ptr + (s * num_tokens + t) * max_rank + r, acc.to(out_ptr.dtype.element_ty),
             mask=r < rank)


@triton.jit
def _expand_kernel(y_ptr, buf_ptr, b_ptr, slots_ptr, offsets_ptr, num_tokens, num_out, rank,
                   NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    d_out = tl.where(slot >= 0, num_out, 0)  # no adapter: every mask is false
    slot = tl.maximum(slot, 0)
    s = tl.zeros((BLOCK_N,), dtype=tl.int32)  # the slice each output column belongs to
    for i in tl.static_range(1, NUM_SLICES):
        s += (n >= tl.load(offsets_ptr + i)).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    mask = (n[:, None] < d_out) & (r[None, :] < rank)
    buf = tl.load(buf_ptr + (s[:, None] * num_tokens + t) * rank + r[None, :], mask=mask,
                  other=0.0)
    b = tl.load(b_ptr + (slot * num_out + n[:, None]) * rank + r[None, :], mask=mask,
                other=0.0)
    delta = tl.sum(buf.to(tl.float32) * b.to(tl.float32), axis=1)
    y = tl.load(y_ptr + t * num_out + n, mask=n < d_out, other=0.0)
    tl.store(y_ptr + t * num_out + n, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
             mask=n < d_out)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """As `runtime.plugins.lora_ops.lora_shrink`."""
    num_tokens, d_in = x.shape
    num_slices, rank = a.size(1), a.size(2)
    out = a.new_zeros(num_slices, num_tokens, rank)
    if num_tokens:
        _shrink_kernel[(num_tokens, num_slices)](
            x.contiguous(), a.contiguous(), batch.token_slots, out, num_tokens, d_in, rank,
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_K=min(128, triton.next_power_of_2(d_in)))
    return out


@functools.cache
def device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A layer's slice offsets on the device: copied once per layer shape and device, not per
    layer and step (the first call is a warm-up outside any graph capture)."""
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, batch: LoRABatch,
                offsets: list[int]) -> torch.Tensor:
    """As `runtime.plugins.lora_ops.lora_expand`; y must be contiguous (it is updated in place)."""
    num_tokens, d_out = y.shape
    rank = b.size(2)
    block_n = min(64, triton.next_power_of_2(d_out))
    if num_tokens:
        _expand_kernel[(num_tokens, triton.cdiv(d_out, block_n))](
            y, buf.contiguous(), b.contiguous(), batch.token_slots,
            device_offsets(tuple(offsets), y.device), num_tokens, d_out, rank,
            NUM_SLICES=buf.size(0), BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank))
    return y
