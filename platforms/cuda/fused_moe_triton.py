"""`fused_moe` as Triton kernels, vLLM's sorted-token scheme, for GPU platforms to answer the
`runtime_custom_op` hook with. Tested on the CPU under TRITON_INTERPRET=1 against
`runtime.plugins.ops.fused_moe`.

`moe_align_block_size` sorts the (token, expert) pairs by expert and pads each expert's group to
a multiple of BLOCK_M, so every block of BLOCK_M pairs belongs to one expert. Then one kernel
runs each block's gate and up GEMMs against its expert's `w13` rows with silu(gate) * up applied
in registers, and a second runs the down GEMM against `w2` and scales each row by its router
weight; the k rows of each token are summed last. Nothing waits on the host (the grid is sized
for the worst padding and surplus blocks exit at once), so CUDA graphs can record it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids): sorted_ids [num_blocks * block_m] holds the flat pair indices
    (t * k + j) grouped by expert, each group padded to a multiple of block_m with the value
    T * k; expert_ids [num_blocks] is each block's expert, -1 past the last group. Pairs whose
    id is -1 (an expert another rank holds) are left out."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    # counts by scatter, not bincount, which asks the host for the largest id
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat + 1, torch.ones_like(flat))
    skipped, counts = counts[0], counts[1:]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)  # the -1 pairs first, then expert by expert
    expert = flat[order]
    rank_in_group = (torch.arange(num_pairs, device=device) - skipped
                     - (counts.cumsum(0) - counts)[expert.clamp(min=0)])
    dest = torch.where(expert >= 0, (padded_end - padded)[expert.clamp(min=0)] + rank_in_group,
                       num_blocks * block_m)  # one slot past the end takes the -1 pairs
    sorted_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.long,
                            device=device)
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:-1], expert_ids


@triton.jit
def _block(expert_ids_ptr, sorted_ids_ptr, num_pairs, width, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """This program's expert (-1: no work), its rows' pair indices and which are real pairs,
    its output columns and which are within `width`."""
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, pair < num_pairs, n, n < width


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, hidden,
                    inter, top_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, inter + n])."""
    expert, pair, pair_ok, n, n_ok = _block(expert_ids_ptr, sorted_ids_ptr, num_pairs, inter,
                                            BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    token = pair // top_k
    w_base = w_ptr + expert * 2 * inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + n[None, :] * hidden + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (inter + n[None, :]) * hidden + k[:, None], mask=w_mask,
                       other=0.0)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pair[:, None] * inter + n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs,
                 hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, n] = weight[pair] * (act[pair] . w2[e, n])."""
    expert, pair, pair_ok, n, n_ok = _block(expert_ids_ptr, sorted_ids_ptr, num_pairs, hidden,
                                            BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    w_base = w_ptr + expert * hidden * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(act_ptr + pair[:, None] * inter + k[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * inter + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + pair, mask=pair_ok, other=0.0)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None] * hidden + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & n_ok[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Small blocks when each expert gets few rows (decode), so padding stays small."""
    return 16 if num_pairs <= 32 * num_experts else 64


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """As `runtime.plugins.ops.fused_moe`."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, size = w13.size(0), w2.size(2), hidden.size(1)
    num_pairs = num_tokens * top_k
    out = hidden.new_zeros(num_tokens, top_k, size)
    if num_pairs == 0:
        return out.sum(1)
    block_m = _block_m(num_pairs, num_experts)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, block_m, num_experts)
    precision = "ieee" if hidden.dtype == torch.float32 else None  # no TF32 for float32
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    act = hidden.new_empty(num_pairs, inter)
    block_n, block_k = 64, 32
    _gate_up_kernel[(expert_ids.numel(), triton.cdiv(inter, block_n))](
        hidden, w13, act, sorted_ids, expert_ids, num_pairs, size, inter, top_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    _down_kernel[(expert_ids.numel(), triton.cdiv(size, block_n))](
        act, w2, topk_weights.float().contiguous(), out, sorted_ids, expert_ids, num_pairs, size,
        inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    return out.sum(1)
