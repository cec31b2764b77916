"""Triton kernels over the paged KV cache: writing this step's K/V, and paged attention.

One attention launch serves a whole flat batch, prefill chunks and decodes alike: the grid is
(request, query tile, KV head), and each program attends the query heads of one GQA group for
up to BLOCK_M of its request's new tokens, walking the request's context through the block table
BLOCK_N positions at a time with an online softmax. Packing the group's heads into the rows of
one tile lets a decode (one token) still fill a 16-row tensor-core tile when the group is large,
and loads each K/V tile once for the whole group.

Positions are gathered through the block table one by one, so BLOCK_N is independent of the
cache's block size (any size works, powers of two or not). Kernels are compiled on first use
for each shape class; with TRITON_INTERPRET=1 (set before this module is imported) they run on
the CPU through Triton's interpreter, which is how the tests check them against the portable
torch backend.

Layout: a layer's cache is [2, num_blocks, block_size, num_kv_heads, head_size] (the base
layout); `k_cache`/`v_cache` are its two halves, and only their last dimension must be
contiguous. Slots < 0 in `slot_mapping` are padding (graph replay) and are not written.

An FP8 cache (e4m3fn or e5m2, see `base`) is handed to the kernels as bytes: they encode
`x / scale` (round to nearest even, saturated) and decode it with integer operations, which
any GPU Triton targets runs (and Triton's interpreter, whose own FP8 casts do not round as
torch does). The scales come as one-element tensors, read by the kernels, so a recorded graph
follows later changes; k_scale multiplies the scores and v_scale the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.attention_backends.base import AttentionMetadata, is_fp8

# Rows of one attention tile (query tokens x heads of a GQA group): 16 is the smallest tile
# tensor cores take, used for decode-only batches; prefill tiles are larger.
DECODE_ROWS = 16
PREFILL_ROWS = 64
KV_TILE = 32


def fp8_format(dtype: torch.dtype) -> dict[str, float]:
    """The kernels' FP8 parameters for a cache dtype (FP8_MANT 0: the cache is not FP8)."""
    if not is_fp8(dtype):
        return dict(FP8_MANT=0, FP8_BIAS=0, FP8_MAX=0.0, FP8_MIN_NORMAL=0.0, FP8_SUBNORMAL=0.0)
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    bias = 7 if dtype == torch.float8_e4m3fn else 15
    return dict(FP8_MANT=mant, FP8_BIAS=bias, FP8_MAX=torch.finfo(dtype).max,
                FP8_MIN_NORMAL=2.0 ** (1 - bias), FP8_SUBNORMAL=2.0 ** (1 - bias - mant))


@triton.jit
def _fp8_encode(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
                MIN_NORMAL: tl.constexpr, SUBNORMAL: tl.constexpr):
    """float32 x as FP8 bytes: round to nearest even, |x| saturated to MAX."""
    negative = x.to(tl.int32, bitcast=True) < 0
    a = tl.minimum(tl.abs(x), MAX)
    # normal: rebias the exponent, then drop 23 - MANT mantissa bits rounding to nearest even
    bits = a.to(tl.int32, bitcast=True) - ((127 - BIAS) << 23)
    normal = (bits + ((1 << (22 - MANT)) - 1) + ((bits >> (23 - MANT)) & 1)) >> (23 - MANT)
    # subnormal: a count of SUBNORMAL steps; adding 2^23 rounds it to an integer, to nearest even
    steps = ((a / SUBNORMAL + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a < MIN_NORMAL, steps, normal)
    return (mag | tl.where(negative, 0x80, 0)).to(tl.uint8)


@triton.jit
def _fp8_decode(b, MANT: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL: tl.constexpr):
    """FP8 bytes as float32 values (exact)."""
    b = b.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << (23 - MANT)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    value = tl.where((mag >> MANT) == 0, mag.to(tl.float32) * SUBNORMAL, normal)
    return tl.where(b >= 0x80, -value, value)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr,
                     FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                     FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_SIZE
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + d
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=d_ok)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=d_ok)
    if FP8_MANT > 0:
        k = _fp8_encode(k.to(tl.float32) / tl.load(k_scale_ptr), FP8_MANT, FP8_BIAS, FP8_MAX,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL)
        v = _fp8_encode(v.to(tl.float32) / tl.load(v_scale_ptr), FP8_MANT, FP8_BIAS, FP8_MAX,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, scale, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_SUBNORMAL: tl.constexpr):
    req = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens cached before this step's new ones

    # Row r of the tile is query token tile*BLOCK_M + r // GROUP_P2, head r % GROUP_P2 of the group.
    rows = tl.arange(0, BLOCK_M * GROUP_P2)
    token = tile * BLOCK_M + rows // GROUP_P2
    member = rows % GROUP_P2
    row_ok = (token < q_len) & (member < GROUP)
    head = kv_head * GROUP + member
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_SIZE
    q_off = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context_len + token
    if FP8_MANT > 0:
        scale = scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_P2], tl.float32)

    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)  # causal: last row's pos + 1
    kv_start = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(context_len + tile * BLOCK_M - SLIDING_WINDOW + 1, 0)
        kv_start = (first // BLOCK_N) * BLOCK_N
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                    mask=pos_ok[None, :] & d_ok[:, None], other=0)
        if FP8_MANT > 0:
            k = _fp8_decode(k, FP8_MANT, FP8_BIAS, FP8_SUBNORMAL)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                    mask=pos_ok[:, None] & d_ok[None, :], other=0)
        if FP8_MANT > 0:
            v = _fp8_decode(v, FP8_MANT, FP8_BIAS, FP8_SUBNORMAL)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8_MANT > 0:
        out = out * tl.load(v_scale_ptr)
    o_off = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_off + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` [T] of a [num_blocks, block_size, Hkv, D]
    cache half each (FP8: divided by the one-element `k_scale`/`v_scale`); negative slots are
    skipped."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    fp8 = fp8_format(k_cache.dtype)
    if fp8["FP8_MANT"]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.size(1), HEAD_SIZE=head_size, HEAD_P2=_pow2(head_size), **fp8)


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                    sliding_window: int | None, k_scale: torch.Tensor,
                    v_scale: torch.Tensor) -> None:
    """Attend query [T, H, D] over the paged cache into `out` [T, H, D] (see the module doc)."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.size(2)
    group = num_heads // num_kv_heads
    group_p2 = _pow2(group)
    rows = DECODE_ROWS if metadata.max_query_len == 1 else PREFILL_ROWS
    block_m = max(1, rows // group_p2)
    assert query.stride(-1) == out.stride(-1) == k_cache.stride(-1) == 1
    grid = (metadata.num_reqs, triton.cdiv(metadata.max_query_len, block_m), num_kv_heads)
    fp8 = fp8_format(k_cache.dtype)
    if fp8["FP8_MANT"]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, BLOCK_SIZE=k_cache.size(1), HEAD_SIZE=head_size,
        HEAD_P2=_pow2(head_size, 16), BLOCK_M=block_m, BLOCK_N=KV_TILE,
        SLIDING_WINDOW=sliding_window or 0, FP8_MANT=fp8["FP8_MANT"], FP8_BIAS=fp8["FP8_BIAS"],
        FP8_SUBNORMAL=fp8["FP8_SUBNORMAL"],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None)  # "tf32" fails on AMD
