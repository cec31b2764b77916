"""The chunked prefill halves of the recurrent ops as Triton kernels: `mamba2_chunk_scan` and
`chunk_gated_delta_rule`, for GPU platforms to answer the `runtime_custom_op` hook with.

Each program owns one sequence, one head and one block of the state's columns (Mamba 2's head
dims, the delta rule's value columns) and walks the sequence's chunks in order with that block
of the state in registers: within a chunk the quadratic form through `tl.dot`, between chunks
the recurrence. The delta rule's chunk is the WY form of flash-linear-attention's
`chunk_gated_delta_rule`, its unit lower triangular system solved by forward substitution in
the kernel. The states after the rows in `checkpoint_rows` (the prefix cache's block ends) are
written from the chunk that holds each row. Dots run in IEEE float32 (no TF32), as the portable
ops compute. Tested on the CPU under TRITON_INTERPRET=1 against `runtime.plugins.recurrent_ops`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.plugins.recurrent_ops import mamba2_dt

# The chunk a program holds in registers is at most this many rows: `chunk_size` only changes
# the rounding of the result, and a [256, 256] score tile would spill.
MAX_CHUNK = 64


def _tile(n: int) -> int:
    """A tile side for n: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _chunk(chunk_size: int) -> int:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return min(chunk_size, MAX_CHUNK)


def _checkpoint_bounds(checkpoint_rows: torch.Tensor | None,
                       checkpoint_states: torch.Tensor | None,
                       query_start_loc: torch.Tensor, state_shape: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, states, bounds [S + 1]): sequence s's checkpoints are rows[bounds[s]:bounds[s+1]].
    Without checkpoints, empty stand-ins (the kernel reads none of them)."""
    if checkpoint_rows is None:
        bounds = torch.zeros_like(query_start_loc)
        return bounds, torch.empty(0, device=query_start_loc.device), bounds
    if (checkpoint_states is None or checkpoint_states.dtype != torch.float32
            or not checkpoint_states.is_contiguous()
            or tuple(checkpoint_states.shape) != (len(checkpoint_rows), *state_shape)):
        raise ValueError("checkpoint_states must be contiguous float32 "
                         f"[{len(checkpoint_rows)}, {', '.join(map(str, state_shape))}]")
    rows = checkpoint_rows.to(query_start_loc.dtype).contiguous()
    bounds = torch.searchsorted(rows, query_start_loc.contiguous()).to(query_start_loc.dtype)
    return rows, checkpoint_states, bounds


def _start_flags(initial_state: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                 seqs: int, device: torch.device) -> torch.Tensor:
    """[S] int32: 1 where a sequence starts from its row of `initial_state`, 0 from zeros."""
    if initial_state is None:
        return torch.zeros(seqs, dtype=torch.int32, device=device)
    if has_initial_state is None:
        return torch.ones(seqs, dtype=torch.int32, device=device)
    return has_initial_state.to(torch.int32).contiguous()


def _final_states(initial_state: torch.Tensor | None, shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _mamba2_chunk_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, qsl_ptr, init_ptr,
                         has_init_ptr, final_ptr, out_ptr, ck_rows_ptr, ck_bounds_ptr,
                         ck_states_ptr, heads, groups, p, n, chunk,
                         HAS_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    j = tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_L)
    group = h // (heads // groups)
    lo = tl.load(qsl_ptr + s).to(tl.int64)  # int64 offsets: T x H x P passes 2 ** 31
    hi = tl.load(qsl_ptr + s + 1).to(tl.int64)
    ck_lo = tl.load(ck_bounds_ptr + s)
    ck_hi = tl.load(ck_bounds_ptr + s + 1)
    a = tl.load(a_ptr + h)
    state_mask = (i[:, None] < p) & (j[None, :] < n)
    state_offsets = (s * heads + h) * p * n + i[:, None] * n + j[None, :]
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if tl.load(has_init_ptr + s) != 0:
        state = tl.load(init_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    for c in range(lo, hi, chunk):
        t = c + r
        row_mask = (r < chunk) & (t < hi)
        dt = tl.load(dt_ptr + t * heads + h, mask=row_mask, other=0.0)
        cum = tl.cumsum(dt * a, 0)  # [L]; padded rows add nothing
        x_mask = row_mask[:, None] & (i[None, :] < p)
        x = tl.load(x_ptr + (t[:, None] * heads + h) * p + i[None, :], mask=x_mask,
                    other=0.0).to(tl.float32)
        bc_offsets = (t[:, None] * groups + group) * n + j[None, :]
        bc_mask = row_mask[:, None] & (j[None, :] < n)
        b = tl.load(b_ptr + bc_offsets, mask=bc_mask, other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + bc_offsets, mask=bc_mask, other=0.0).to(tl.float32)
        xdt = x * dt[:, None]
        # exp of a masked difference: above the diagonal it would overflow
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = tl.dot(cc, tl.trans(b), input_precision="ieee") * decay
        y = tl.dot(scores, xdt, input_precision="ieee")
        y += tl.exp(cum)[:, None] * tl.dot(cc, tl.trans(state), input_precision="ieee")
        if HAS_D:
            y += tl.load(d_ptr + h) * x
        tl.store(out_ptr + (t[:, None] * heads + h) * p + i[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=x_mask)
        for k in range(ck_lo, ck_hi):
            row = tl.load(ck_rows_ptr + k) - c
            if (row >= 0) & (row < chunk):
                cum_row = tl.sum(tl.where(r == row, cum, 0.0), 0)
                to_row = tl.exp(tl.where(r <= row, cum_row - cum, float("-inf")))
                at_row = state * tl.exp(cum_row) + tl.dot(
                    tl.trans(xdt * to_row[:, None]), b, input_precision="ieee")
                tl.store(ck_states_ptr + (k * heads + h) * p * n + i[:, None] * n + j[None, :],
                         at_row, mask=state_mask)
        cum_end = tl.sum(tl.where(r == BLOCK_L - 1, cum, 0.0), 0)
        state = state * tl.exp(cum_end) + tl.dot(
            tl.trans(xdt * tl.exp(cum_end - cum)[:, None]), b, input_precision="ieee")
    tl.store(final_ptr + state_offsets, state.to(final_ptr.dtype.element_ty), mask=state_mask)


def mamba2_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      dt_softplus: bool, query_start_loc: torch.Tensor,
                      initial_state: torch.Tensor | None = None,
                      has_initial_state: torch.Tensor | None = None, chunk_size: int = 256,
                      dt_limit: tuple[float, float] = (0.0, float("inf")),
                      checkpoint_rows: torch.Tensor | None = None,
                      checkpoint_states: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `runtime.plugins.recurrent_ops.mamba2_chunk_scan`; chunks of at most MAX_CHUNK rows,
    `checkpoint_states` contiguous float32."""
    seqs = query_start_loc.numel() - 1
    heads, p = x.shape[1:]
    groups, n = B.shape[1:]
    if heads % groups:
        raise ValueError(f"{groups} groups do not divide {heads} heads")
    chunk = _chunk(chunk_size)
    dt = mamba2_dt(dt, dt_bias, dt_softplus, dt_limit).contiguous()
    ck_rows, ck_states, ck_bounds = _checkpoint_bounds(checkpoint_rows, checkpoint_states,
                                                       query_start_loc, (heads, p, n))
    final = _final_states(initial_state, (seqs, heads, p, n), x.device)
    out = torch.empty_like(x)
    block_p = min(_tile(p), 32)
    _mamba2_chunk_kernel[(seqs, heads, triton.cdiv(p, block_p))](
        x.contiguous(), dt, A.float().contiguous(), B.contiguous(), C.contiguous(),
        D.float().contiguous() if D is not None else dt, query_start_loc.contiguous(),
        initial_state.contiguous() if initial_state is not None else final,
        _start_flags(initial_state, has_initial_state, seqs, x.device), final, out, ck_rows,
        ck_bounds, ck_states, heads, groups, p, n, chunk, HAS_D=D is not None,
        BLOCK_L=_tile(chunk), BLOCK_P=block_p, BLOCK_N=_tile(n))
    return out, final


@triton.jit
def _gated_delta_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, qsl_ptr, init_ptr,
                              has_init_ptr, final_ptr, out_ptr, ck_rows_ptr, ck_bounds_ptr,
                              ck_states_ptr, k_heads, v_heads, dk, dv, scale, chunk,
                              L2NORM: tl.constexpr, BLOCK_L: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_L)
    kh = h // (v_heads // k_heads)
    lo = tl.load(qsl_ptr + s).to(tl.int64)  # int64 offsets: T x H x P passes 2 ** 31
    hi = tl.load(qsl_ptr + s + 1).to(tl.int64)
    ck_lo = tl.load(ck_bounds_ptr + s)
    ck_hi = tl.load(ck_bounds_ptr + s + 1)
    state_mask = (i[:, None] < dk) & (cols[None, :] < dv)
    state_offsets = (s * v_heads + h) * dk * dv + i[:, None] * dv + cols[None, :]
    state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    if tl.load(has_init_ptr + s) != 0:
        state = tl.load(init_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    for c in range(lo, hi, chunk):
        t = c + r
        row_mask = (r < chunk) & (t < hi)
        qk_mask = row_mask[:, None] & (i[None, :] < dk)
        qk_offsets = (t[:, None] * k_heads + kh) * dk + i[None, :]
        q = tl.load(q_ptr + qk_offsets, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offsets, mask=qk_mask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
        v_mask = row_mask[:, None] & (cols[None, :] < dv)
        v_offsets = (t[:, None] * v_heads + h) * dv + cols[None, :]
        v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * v_heads + h, mask=row_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * v_heads + h, mask=row_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        # The values each row writes, u, solve (I + A) u = beta (v - exp(G) k S) with A strictly
        # lower, A[i, j] = beta_i exp(G_i - G_j) k_i . k_j: forward substitution, row by row.
        system = tl.where(r[:, None] > r[None, :],
                          beta[:, None] * tl.dot(k, tl.trans(k), input_precision="ieee") * decay,
                          0.0)
        u = beta[:, None] * (v - tl.exp(cum)[:, None]
                             * tl.dot(k, state, input_precision="ieee"))
        for row in range(1, chunk):
            weights = tl.sum(tl.where(r[:, None] == row, system, 0.0), 0)  # A[row, :]
            update = tl.sum(weights[:, None] * u, 0)
            u = tl.where(r[:, None] == row, u - update[None, :], u)
        o = tl.exp(cum)[:, None] * tl.dot(q, state, input_precision="ieee")
        o += tl.dot(tl.dot(q, tl.trans(k), input_precision="ieee") * decay, u,
                    input_precision="ieee")
        tl.store(out_ptr + v_offsets, o.to(out_ptr.dtype.element_ty), mask=v_mask)
        for ck in range(ck_lo, ck_hi):
            row = tl.load(ck_rows_ptr + ck) - c
            if (row >= 0) & (row < chunk):
                cum_row = tl.sum(tl.where(r == row, cum, 0.0), 0)
                to_row = tl.exp(tl.where(r <= row, cum_row - cum, float("-inf")))
                at_row = state * tl.exp(cum_row) + tl.dot(
                    tl.trans(k * to_row[:, None]), u, input_precision="ieee")
                tl.store(ck_states_ptr + (ck * v_heads + h) * dk * dv + i[:, None] * dv
                         + cols[None, :], at_row, mask=state_mask)
        cum_end = tl.sum(tl.where(r == BLOCK_L - 1, cum, 0.0), 0)
        state = state * tl.exp(cum_end) + tl.dot(
            tl.trans(k * tl.exp(cum_end - cum)[:, None]), u, input_precision="ieee")
    tl.store(final_ptr + state_offsets, state.to(final_ptr.dtype.element_ty), mask=state_mask)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, query_start_loc: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           has_initial_state: torch.Tensor | None = None,
                           use_qk_l2norm: bool = False, scale: float | None = None,
                           chunk_size: int = 64, checkpoint_rows: torch.Tensor | None = None,
                           checkpoint_states: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `runtime.plugins.recurrent_ops.chunk_gated_delta_rule`; chunks of at most MAX_CHUNK
    rows, `checkpoint_states` contiguous float32."""
    seqs = query_start_loc.numel() - 1
    k_heads, dk = q.shape[1:]
    v_heads, dv = v.shape[1:]
    if v_heads % k_heads:
        raise ValueError(f"{k_heads} key heads do not divide {v_heads} value heads")
    chunk = _chunk(chunk_size)
    ck_rows, ck_states, ck_bounds = _checkpoint_bounds(checkpoint_rows, checkpoint_states,
                                                       query_start_loc, (v_heads, dk, dv))
    final = _final_states(initial_state, (seqs, v_heads, dk, dv), v.device)
    out = torch.empty_like(v)
    block_v = min(_tile(dv), 32)
    _gated_delta_chunk_kernel[(seqs, v_heads, triton.cdiv(dv, block_v))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        query_start_loc.contiguous(),
        initial_state.contiguous() if initial_state is not None else final,
        _start_flags(initial_state, has_initial_state, seqs, v.device), final, out, ck_rows,
        ck_bounds, ck_states, k_heads, v_heads, dk, dv,
        scale if scale is not None else dk ** -0.5, chunk, L2NORM=use_qk_l2norm,
        BLOCK_L=_tile(chunk), BLOCK_K=_tile(dk), BLOCK_V=block_v)
    return out, final
