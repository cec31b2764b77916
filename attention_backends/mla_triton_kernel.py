"""The Triton kernel of `mla_triton` (imported on first use, so choosing that backend never
needs Triton to be importable)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_kernel(q_ptr, cache_ptr, block_table_ptr, seq_len_ptr, out_ptr, scale,
                      stride_qs, stride_qh, stride_cb, stride_ct, stride_bt, stride_os,
                      stride_oh, num_heads, block_size, rank, rope,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                      BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < rank
    r_ok = offs_r < rope
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_latent = tl.load(q_rows + offs_l[None, :], mask=head_ok[:, None] & l_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + rank + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :],
                     other=0.0)
    seq_len = tl.load(seq_len_ptr + seq)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        block = tl.load(block_table_ptr + seq * stride_bt + pos // block_size, mask=pos_ok,
                        other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % block_size) * stride_ct
        latent = tl.load(rows[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :],
                         other=0.0)
        k_rope = tl.load(rows[:, None] + rank + offs_r[None, :],
                         mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.where(pos_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent,
                                            input_precision=DOT_PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & l_ok[None, :])
