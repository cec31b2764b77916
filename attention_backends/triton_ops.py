"""Triton kernels over the paged KV cache: writing this step's K/V, and paged attention.

One attention launch serves a whole flat batch, prefill chunks and decodes alike: the grid is
(request, query tile, KV head), and each program attends the query heads of one GQA group for
up to BLOCK_M of its request's new tokens, walking the request's context through the block table
BLOCK_N positions at a time with an online softmax. Packing the group's heads into the rows of
one tile lets a decode (one token) still fill a 16-row tensor-core tile when the group is large,
and loads each K/V tile once for the whole group. The tile is the largest of a short list whose
operands fit in the device's shared memory per block, as Triton's driver reports it (MI300's
64 KiB LDS takes smaller tiles than an H100's 227 KiB).

A decode-only batch too small to occupy the device (requests x KV heads below its
multiprocessors) is split along the context instead (flash-decoding): the grid becomes
(request, piece, KV head), each program writes its piece's output and log-sum-exp, and a second
kernel merges the pieces. The split count follows from host-side sizes only (requests, longest
context), so a recorded graph keeps it; it is a runtime argument, so a growing context compiles
nothing new.

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

Attention sinks (gpt-oss: one learned logit per query head, no value) start each row's online
softmax: the running maximum is the sink and the running sum 1, as if the sink were a first key
whose value is zero. A split decode starts only its first piece so, and the merge then counts
the sink once, through that piece's log-sum-exp.

Under decode context parallel (DCP_WORLD > 1) the cache holds this rank's shard of each
context: the loop walks local indices up to the shard's length, through the block table as
ever, and masks each key at its real position (the interleave rule of `context_parallel`), so
causality, sliding windows and chunks hold exactly; the bounds of the walk are the real
positions' counts in the shard. With RETURN_LSE each row's log-sum-exp is written too (the
merge writes it for a split decode). At DCP_WORLD 1 the position is the local index: the
kernel compiles as before.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from runtime.attention_backends.base import AttentionMetadata, is_fp8
from runtime.attention_backends.context_parallel import ContextParallel

# Rows of one attention tile (query tokens x heads of a GQA group) by K/V positions per step:
# 16 is the smallest tile tensor cores take, used for decode-only batches; prefill tiles are
# larger. Each list is in order of preference; the first whose operands fit in the device's
# shared memory per block is used (`attention_tile`).
DECODE_TILES = [(16, 32), (16, 16)]
PREFILL_TILES = [(64, 32), (32, 32), (16, 32), (16, 16)]
# Split-KV decoding (flash-decoding): when a decode batch has fewer (request, KV head) programs
# than the device has multiprocessors, each request's context is cut into up to MAX_SPLITS
# pieces of at least MIN_SPLIT_LEN positions, attended in parallel and merged by log-sum-exp.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64
# What the interpreter (TRITON_INTERPRET=1, no device) stands for: no shared-memory limit, and
# an H100's 132 multiprocessors, so the split path runs in the CPU tests as it would there.
INTERPRETER_LIMITS = (1 << 31, 132)


@functools.cache
def device_limits(index: int) -> tuple[int, int]:
    """(shared memory one block may use in bytes, multiprocessors) of device `index`, as
    Triton's driver reports them (CUDA's opt-in per-block limit; AMD's LDS size)."""
    if triton.knobs.runtime.interpret:
        return INTERPRETER_LIMITS
    props = driver.active.utils.get_device_properties(index)
    return props["max_shared_mem"], props["multiprocessor_count"]


def tile_shared_bytes(rows: int, kv_tile: int, head_p2: int, dtype: torch.dtype) -> int:
    """Shared memory the attention kernel asks for with one tile shape: the dot operands (the
    query tile, one K and one V tile) and the probabilities' layout change, in the compute
    dtype, plus a margin. Matches what Triton allocates for NVIDIA targets to within the margin
    (tests/device/shared_memory.py measures it): 69,888 B at 64 rows, head 256, bf16."""
    size = torch.finfo(dtype).bits // 8
    return size * (rows * head_p2 + 2 * kv_tile * head_p2 + rows * kv_tile) + 1024


def attention_tile(prefill: bool, group_p2: int, head_p2: int, dtype: torch.dtype,
                   shared_limit: int) -> tuple[int, int]:
    """(query tokens per tile, K/V positions per step): the preferred tile whose operands fit
    in `shared_limit` bytes, else the smallest (whose launch then reports the shortfall)."""
    tiles = PREFILL_TILES if prefill else DECODE_TILES
    for rows, kv_tile in tiles:
        block_m = max(1, rows // group_p2)
        if tile_shared_bytes(block_m * group_p2, kv_tile, head_p2, dtype) <= shared_limit:
            return block_m, kv_tile
    rows, kv_tile = tiles[-1]
    return max(1, rows // group_p2), kv_tile


def decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, processors: int,
                  kv_tile: int = 32) -> tuple[int, int]:
    """(pieces, positions per piece) to cut each context of a decode-only batch into, a piece a
    whole number of K/V tiles; (1, 0), no split, when the (request, KV head) programs already
    cover the multiprocessors or the contexts are short."""
    programs = num_reqs * num_kv_heads
    pieces = min(MAX_SPLITS, triton.cdiv(processors, programs), max_seq_len // MIN_SPLIT_LEN)
    if programs >= processors or pieces <= 1:
        return 1, 0
    length = triton.cdiv(triton.cdiv(max_seq_len, pieces), kv_tile) * kv_tile
    return triton.cdiv(max_seq_len, length), length


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
        out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, scale, k_scale_ptr, v_scale_ptr, sinks_ptr, num_splits, split_len,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_cb, stride_cs, stride_ch,
        stride_bt, dcp_rank, dcp_interleave, NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_SUBNORMAL: tl.constexpr,
        SPLIT: tl.constexpr, SINKS: tl.constexpr, DCP_WORLD: tl.constexpr,
        RETURN_LSE: tl.constexpr):
    req = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    split = 0
    if SPLIT:  # decodes only: axis 1 walks the pieces of the context, not query tiles
        split = tile
        tile = 0
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
    if SINKS:  # the sink as a first key of value zero: in the first piece only, when split
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        if SPLIT:
            sink = tl.where(split == 0, sink, float("-inf"))
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)

    # the positions the tile's rows see lie in [kv_start, kv_end)
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)  # causal: last row's pos + 1
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + tile * BLOCK_M - SLIDING_WINDOW + 1, 0)
    if CHUNK > 0:  # the chunk of the tile's first row starts it
        first_pos = context_len + tile * BLOCK_M
        kv_start = first_pos - first_pos % CHUNK
    if DCP_WORLD > 1:  # from here on the loop walks this rank's local indices
        kv_end = _dcp_local_len(kv_end, dcp_rank, dcp_interleave, DCP_WORLD)
        if SLIDING_WINDOW > 0 or CHUNK > 0:
            kv_start = _dcp_local_len(kv_start, dcp_rank, dcp_interleave, DCP_WORLD)
    kv_start = (kv_start // BLOCK_N) * BLOCK_N
    if SPLIT:
        kv_start = tl.maximum(kv_start, split * split_len)
        kv_end = tl.minimum(kv_end, (split + 1) * split_len)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        local = start + tl.arange(0, BLOCK_N)  # index in the shard: the position unless DCP
        pos_ok = local < kv_end
        block = tl.load(table + local // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (local % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        pos = local
        if DCP_WORLD > 1:  # the interleave rule (context_parallel.ContextParallel.positions)
            pos = (local // dcp_interleave * (dcp_interleave * DCP_WORLD)
                   + dcp_rank * dcp_interleave + local % dcp_interleave)
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                    mask=pos_ok[None, :] & d_ok[:, None], other=0)
        if FP8_MANT > 0:
            k = _fp8_decode(k, FP8_MANT, FP8_BIAS, FP8_SUBNORMAL)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        if CHUNK > 0:
            visible = visible & (pos[None, :] >= q_pos[:, None] - q_pos[:, None] % CHUNK)
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
    tl.store(out_ptr + o_off + split * stride_os + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if SPLIT or RETURN_LSE:  # this piece's (or row's) log-sum-exp (-inf: it saw nothing)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        row = ((q_start + token).to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _dcp_local_len(n, rank, interleave, WORLD: tl.constexpr):
    """How many of positions [0, n) this DCP rank holds (`ContextParallel.local_len`)."""
    run = interleave * WORLD
    return n // run * interleave + tl.minimum(tl.maximum(n % run - rank * interleave, 0),
                                              interleave)


@triton.jit
def _merge_splits_kernel(out_ptr, partial_ptr, lse_ptr, lse_out_ptr, stride_ot, stride_oh,
                         num_splits, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                         HEAD_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
                         RETURN_LSE: tl.constexpr):
    """One (token, head): the pieces' outputs weighted by exp(lse - max lse), and with
    RETURN_LSE the row's log-sum-exp over all pieces."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * NUM_HEADS + head
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_SIZE
    lse = tl.load(lse_ptr + row * num_splits + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty pieces
    parts = tl.load(partial_ptr + (row * num_splits + s[:, None]) * HEAD_SIZE + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        tl.store(lse_out_ptr + row, tl.where(total == 0.0, float("-inf"),
                                             top + tl.log(tl.where(total == 0.0, 1.0, total))))


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
                    v_scale: torch.Tensor, sinks: torch.Tensor | None = None,
                    attention_chunk_size: int | None = None, dcp: ContextParallel | None = None,
                    lse: torch.Tensor | None = None) -> None:
    """Attend query [T, H, D] over the paged cache into `out` [T, H, D] (see the module doc);
    `sinks` [H] float32, when given, are the heads' attention-sink logits; with
    `attention_chunk_size` C, a token at position p sees keys [p - p % C, p] only. With `dcp`,
    the cache and block tables hold this rank's shard of each context; with `lse` [T, H]
    float32, each row's log-sum-exp is written there (-inf: the row saw no key)."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.size(2)
    group = num_heads // num_kv_heads
    group_p2, head_p2 = _pow2(group), _pow2(head_size, 16)
    shared_limit, processors = device_limits(query.device.index or 0)
    decode = metadata.max_query_len == 1
    block_m, kv_tile = attention_tile(not decode, group_p2, head_p2, query.dtype, shared_limit)
    assert query.stride(-1) == out.stride(-1) == k_cache.stride(-1) == 1
    dcp = dcp or ContextParallel()
    # the longest shard: at most `interleave` of each run of `interleave x world_size` positions
    run = dcp.interleave * dcp.world_size
    max_kv_len = triton.cdiv(metadata.max_seq_len, run) * dcp.interleave
    splits, split_len = (decode_splits(metadata.num_reqs, num_kv_heads, max_kv_len,
                                       processors, kv_tile) if decode else (1, 0))
    target, piece_lse = out, out if lse is None else lse  # unused unless split or lse
    if splits > 1:
        target = torch.empty(num_tokens, num_heads, splits, head_size, dtype=torch.float32,
                             device=query.device)
        piece_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32,
                                device=query.device)
    axis1 = splits if splits > 1 else triton.cdiv(metadata.max_query_len, block_m)
    fp8 = fp8_format(k_cache.dtype)
    if fp8["FP8_MANT"]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _paged_attention_kernel[(metadata.num_reqs, axis1, num_kv_heads)](
        target, piece_lse, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale, k_scale, v_scale,
        k_scale if sinks is None else sinks, splits, split_len,
        query.stride(0), query.stride(1), target.stride(0), target.stride(1),
        target.stride(2) if splits > 1 else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        dcp.rank, dcp.interleave, NUM_HEADS=num_heads, GROUP=group, GROUP_P2=group_p2, BLOCK_SIZE=k_cache.size(1),
        HEAD_SIZE=head_size, HEAD_P2=head_p2, BLOCK_M=block_m, BLOCK_N=kv_tile,
        SLIDING_WINDOW=sliding_window or 0, CHUNK=attention_chunk_size or 0,
        FP8_MANT=fp8["FP8_MANT"], FP8_BIAS=fp8["FP8_BIAS"], FP8_SUBNORMAL=fp8["FP8_SUBNORMAL"],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # "tf32" fails on AMD
        SPLIT=splits > 1, SINKS=sinks is not None, DCP_WORLD=dcp.world_size,
        RETURN_LSE=lse is not None)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, target, piece_lse, piece_lse if lse is None else lse, out.stride(0),
            out.stride(1), splits, NUM_HEADS=num_heads, HEAD_SIZE=head_size,
            HEAD_P2=_pow2(head_size), SPLITS_P2=_pow2(splits), RETURN_LSE=lse is not None)
