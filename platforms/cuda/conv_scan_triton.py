"""Causal conv1d's varlen prefill and Mamba 1's selective scan (prefill and decode) as Triton
kernels, for GPU platforms to answer the `runtime_custom_op` hook with.

`causal_conv1d`: one program per (sequence, block of channels, block of tokens); each reads the
width inputs ending at its tokens from x, or from the sequence's initial state before its first
token, and the first token block also writes the final state. `selective_scan` and
`selective_state_update`: one program per (sequence, block of channels) holding its
[block, N] state in registers and walking the tokens in order (mamba_ssm's design); decode is
the same kernel over one-token sequences that reads and writes the state slots in place.
Tested on the CPU under TRITON_INTERPRET=1 against `runtime.plugins.recurrent_ops`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK_T = 32


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dimension (rows may stay strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _conv_inputs(x_ptr, stride_x, init_base, rows, valid, lo, c, cmask, init_cmask,
                 K: tl.constexpr, HAS_INIT: tl.constexpr):
    """The inputs at batch rows `rows` [BT] for channels c [BC]: from x at and after the
    sequence's first row lo, from its initial state (K inputs, oldest first) before it
    (channels outside `init_cmask` read zeros there)."""
    in_x = rows >= lo
    v = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :],
                mask=(valid & in_x)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        j = rows - lo + K
        old = tl.load(init_base + c[None, :] * K + j[:, None],
                      mask=(valid & ~in_x)[:, None] & init_cmask[None, :],
                      other=0.0).to(tl.float32)
        v = tl.where(in_x[:, None], v, old)
    return v


@triton.jit
def _causal_conv1d_kernel(x_ptr, stride_x, weight_ptr, bias_ptr, loc_ptr, init_ptr, has_ptr,
                          out_ptr, final_ptr, dim, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_INIT: tl.constexpr, HAS_FLAGS: tl.constexpr, SILU: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tb = tl.program_id(2)
    K: tl.constexpr = WIDTH - 1
    cmask = c < dim
    lo = tl.load(loc_ptr + s)
    hi = tl.load(loc_ptr + s + 1)
    init_cmask = cmask
    if HAS_FLAGS:  # loaded per channel: the interpreter takes no scalar mask
        init_cmask = cmask & (tl.load(has_ptr + s + 0 * c) != 0)
    init_base = init_ptr + s * dim * K
    t = lo + tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < hi
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(WIDTH):
        w = tl.load(weight_ptr + c * WIDTH + i, mask=cmask, other=0.0).to(tl.float32)
        acc += w[None, :] * _conv_inputs(x_ptr, stride_x, init_base, t - K + i, tmask, lo, c,
                                         cmask, init_cmask, K, HAS_INIT)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * dim + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])
    k = tl.arange(0, BLOCK_K)
    last = _conv_inputs(x_ptr, stride_x, init_base, hi - K + k, k < K, lo, c, cmask,
                        init_cmask, K, HAS_INIT)
    tl.store(final_ptr + s * dim * K + c[None, :] * K + k[:, None],
             last.to(final_ptr.dtype.element_ty),
             mask=((k < K) & (tb + 0 * k == 0))[:, None] & cmask[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                  has_initial_state: torch.Tensor | None = None, activation: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `runtime.plugins.recurrent_ops.causal_conv1d`."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal conv1d activation {activation!r}: allowed are 'silu' and None")
    dim, width = weight.shape
    loc = query_start_loc.long()
    seqs = loc.numel() - 1
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    final = torch.empty((seqs, dim, width - 1), dtype=dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    longest = int((loc[1:] - loc[:-1]).max()) if seqs else 0
    x = _unit_stride(x)
    init = initial_state.contiguous() if initial_state is not None else x
    block_c = min(triton.next_power_of_2(dim), 64)
    grid = (seqs, triton.cdiv(dim, block_c), max(triton.cdiv(longest, CONV_BLOCK_T), 1))
    _causal_conv1d_kernel[grid](
        x, x.stride(0), weight.contiguous(), bias if bias is not None else x, loc, init,
        has_initial_state.int() if has_initial_state is not None else loc, out, final, dim,
        WIDTH=width, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_FLAGS=has_initial_state is not None, SILU=activation is not None,
        BLOCK_T=CONV_BLOCK_T, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(max(width - 1, 1)))
    return out, final


@triton.jit
def _selective_scan_kernel(x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, stride_x, stride_dt, stride_z,
                           stride_b, stride_c, a_ptr, d_ptr, dt_bias_ptr, loc_ptr, init_ptr,
                           init_rows_ptr, has_ptr, final_ptr, final_rows_ptr, ck_rows_ptr,
                           ck_first_ptr, ck_ptr, out_ptr, dim, n, HAS_INIT: tl.constexpr,
                           HAS_FLAGS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                           HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                           HAS_CK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_N)
    dmask = d < dim
    mask = dmask[:, None] & (j[None, :] < n)
    offsets = d[:, None] * n + j[None, :]
    lo = tl.load(loc_ptr + s)
    hi = tl.load(loc_ptr + s + 1)
    A = tl.load(a_ptr + offsets, mask=mask, other=0.0)
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_INIT:
        use = mask
        if HAS_FLAGS:
            use = mask & (tl.load(has_ptr + s + 0 * offsets) != 0)
        h = tl.load(init_ptr + tl.load(init_rows_ptr + s) * dim * n + offsets, mask=use,
                    other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(d_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_CK:
        next_ck = tl.load(ck_first_ptr + s)
        ck_row = tl.load(ck_rows_ptr + next_ck)
    for t in range(lo, hi):
        x = tl.load(x_ptr + t * stride_x + d, mask=dmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dt + d, mask=dmask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += dt_bias
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # torch's threshold
        b = tl.load(b_ptr + t * stride_b + j, mask=j < n, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_c + j, mask=j < n, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], 1)
        if HAS_D:
            y += D * x
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_z + d, mask=dmask, other=0.0).to(tl.float32)
            y *= z / (1.0 + tl.exp(-z))
        tl.store(out_ptr + t * dim + d, y.to(out_ptr.dtype.element_ty), mask=dmask)
        if HAS_CK:
            # scalar conditions broadcast to the tile: the interpreter takes no scalar mask
            tl.store(ck_ptr + next_ck * dim * n + offsets, h,
                     mask=mask & (ck_row + 0 * offsets == t))
            hit = t == ck_row
            next_ck += hit.to(next_ck.dtype)
            ck_row = tl.load(ck_rows_ptr + next_ck)
    tl.store(final_ptr + tl.load(final_rows_ptr + s) * dim * n + offsets,
             h.to(final_ptr.dtype.element_ty), mask=mask)


def _scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
          D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
          dt_softplus: bool, loc: torch.Tensor, init: torch.Tensor | None,
          init_rows: torch.Tensor, has: torch.Tensor | None, final: torch.Tensor,
          final_rows: torch.Tensor, checkpoint_rows: torch.Tensor | None,
          checkpoint_states: torch.Tensor | None) -> torch.Tensor:
    """Launch the scan over the varlen batch cut by `loc`: the state of sequence s starts
    from init[init_rows[s]] and ends in final[final_rows[s]] (the same slots for decode)."""
    seqs, (dim, n) = loc.numel() - 1, A.shape
    x, dt, B, C = (_unit_stride(t) for t in (x, dt, B, C))
    z = _unit_stride(z) if z is not None else None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ck_rows = ck_first = loc
    if checkpoint_rows is not None:
        if checkpoint_states.dtype != torch.float32 or not checkpoint_states.is_contiguous():
            raise ValueError("selective scan checkpoint states must be contiguous float32 "
                             f"[C, d_inner, N], got {checkpoint_states.dtype} with strides "
                             f"{checkpoint_states.stride()}")
        rows = checkpoint_rows.long()
        ck_first = torch.searchsorted(rows, loc[:-1])
        ck_rows = torch.cat([rows, rows.new_full((1,), -1)])  # -1: no row matches past the end
    block_d = min(triton.next_power_of_2(dim), 16)
    _selective_scan_kernel[(seqs, triton.cdiv(dim, block_d))](
        x, dt, z if z is not None else x, B, C, x.stride(0), dt.stride(0),
        z.stride(0) if z is not None else 0, B.stride(0), C.stride(0), A.float().contiguous(),
        D.contiguous() if D is not None else x, dt_bias.contiguous() if dt_bias is not None
        else x, loc, init if init is not None else x, init_rows,
        has.int() if has is not None else loc, final, final_rows, ck_rows, ck_first,
        checkpoint_states if checkpoint_rows is not None else x, out, dim, n,
        HAS_INIT=init is not None, HAS_FLAGS=has is not None, HAS_D=D is not None,
        HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_CK=checkpoint_rows is not None, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n))
    return out


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                   dt_bias: torch.Tensor | None, dt_softplus: bool,
                   query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                   has_initial_state: torch.Tensor | None = None,
                   checkpoint_rows: torch.Tensor | None = None,
                   checkpoint_states: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `runtime.plugins.recurrent_ops.selective_scan`; checkpoint states must be contiguous
    float32."""
    loc = query_start_loc.long()
    seqs = loc.numel() - 1
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    final = torch.empty((seqs, *A.shape), dtype=dtype, device=x.device)
    rows = torch.arange(seqs, device=x.device)
    init = initial_state.contiguous() if initial_state is not None else None
    out = _scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, loc, init, rows, has_initial_state,
                final, rows, checkpoint_rows, checkpoint_states)
    return out, final


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, dt_softplus: bool,
                           state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """As `runtime.plugins.recurrent_ops.selective_state_update`; the state must be contiguous
    float32."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the Mamba state must be contiguous float32 [slots, d_inner, N], got "
                         f"{state.dtype} with strides {state.stride()}")
    seqs = x.size(0)
    loc = torch.arange(seqs + 1, device=x.device)
    rows = (state_indices.long() if state_indices is not None else loc[:-1]).contiguous()
    return _scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, loc, state, rows, None, state,
                 rows, None, None)
