"""The decode halves of the recurrent ops as Triton kernels: `fused_recurrent_gated_delta_rule`
(one program per sequence, value head and block of value columns, which owns that block of the
state), `causal_conv1d_update` (one program per sequence and block of channels) and
`mamba2_state_update` (one program per sequence, head and block of head dims), for GPU
platforms to answer the `runtime_custom_op` hook with. Tested on the CPU under TRITON_INTERPRET=1
against `runtime.plugins.recurrent_ops`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.plugins.recurrent_ops import mamba2_dt


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, rows_ptr, out_ptr,
                             k_heads, v_heads, dk, dv, scale, L2NORM: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, BLOCK_K)
    kh = h // (v_heads // k_heads)
    q = tl.load(q_ptr + (s * k_heads + kh) * dk + i, mask=i < dk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (s * k_heads + kh) * dk + i, mask=i < dk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    q = q * scale
    mask = (i[:, None] < dk) & (cols[None, :] < dv)
    base = state_ptr + (tl.load(rows_ptr + s) * v_heads + h) * dk * dv
    offsets = i[:, None] * dv + cols[None, :]
    state = tl.load(base + offsets, mask=mask, other=0.0)
    state = state * tl.exp(tl.load(g_ptr + s * v_heads + h).to(tl.float32))
    v = tl.load(v_ptr + (s * v_heads + h) * dv + cols, mask=cols < dv, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + s * v_heads + h).to(tl.float32)
    delta = beta * (v - tl.sum(state * k[:, None], 0))
    state = state + k[:, None] * delta[None, :]
    tl.store(base + offsets, state, mask=mask)
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + (s * v_heads + h) * dv + cols, out.to(out_ptr.dtype.element_ty),
             mask=cols < dv)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                     state_indices: torch.Tensor | None = None,
                                     use_qk_l2norm: bool = False,
                                     scale: float | None = None) -> torch.Tensor:
    """As `runtime.plugins.recurrent_ops.fused_recurrent_gated_delta_rule`; the state must be
    contiguous float32."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the gated delta rule state must be contiguous float32 "
                         f"[slots, Hv, K, V], got {state.dtype} with strides {state.stride()}")
    seqs, k_heads, dk = q.shape
    v_heads, dv = v.shape[1:]
    rows = (state_indices if state_indices is not None
            else torch.arange(seqs, device=v.device)).contiguous()
    out = torch.empty_like(v)
    block_v = min(triton.next_power_of_2(dv), 32)
    grid = (seqs, v_heads, triton.cdiv(dv, block_v))
    _gated_delta_rule_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state,
        rows, out, k_heads, v_heads, dk, dv, scale if scale is not None else dk ** -0.5,
        L2NORM=use_qk_l2norm, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return out


@triton.jit
def _conv1d_update_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, rows_ptr, out_ptr, dim,
                          WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          BLOCK: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < dim
    base = state_ptr + tl.load(rows_ptr + s) * dim * (WIDTH - 1) + c * (WIDTH - 1)
    x = tl.load(x_ptr + s * dim + c, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(weight_ptr + c * WIDTH + WIDTH - 1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(WIDTH - 1):
        old = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        y += old * tl.load(weight_ptr + c * WIDTH + i, mask=mask, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(base + i - 1, old.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(base + WIDTH - 2, x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + s * dim + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = None,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """As `runtime.plugins.recurrent_ops.causal_conv1d_update`; the state must be contiguous."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal conv1d activation {activation!r}: allowed are 'silu' and None")
    if not state.is_contiguous():
        raise ValueError("the conv state must be contiguous [slots, dim, width - 1]")
    seqs, dim = x.shape
    rows = (state_indices if state_indices is not None
            else torch.arange(seqs, device=x.device)).contiguous()
    out = torch.empty_like(x)
    block = min(triton.next_power_of_2(dim), 256)
    _conv1d_update_kernel[(seqs, triton.cdiv(dim, block))](
        x.contiguous(), weight.contiguous(), bias if bias is not None else x, state, rows, out,
        dim, WIDTH=weight.size(1), HAS_BIAS=bias is not None, SILU=activation is not None,
        BLOCK=block)
    return out


@triton.jit
def _mamba2_update_kernel(state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, rows_ptr,
                          out_ptr, heads, groups, p, n, HAS_D: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    j = tl.arange(0, BLOCK_N)
    group = h // (heads // groups)
    dt = tl.load(dt_ptr + s * heads + h)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    x = tl.load(x_ptr + (s * heads + h) * p + i, mask=i < p, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + (s * groups + group) * n + j, mask=j < n, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + (s * groups + group) * n + j, mask=j < n, other=0.0).to(tl.float32)
    mask = (i[:, None] < p) & (j[None, :] < n)
    base = state_ptr + (tl.load(rows_ptr + s) * heads + h) * p * n
    offsets = i[:, None] * n + j[None, :]
    state = tl.load(base + offsets, mask=mask, other=0.0)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(base + offsets, state, mask=mask)
    y = tl.sum(state * c[None, :], 1)
    if HAS_D:
        y += tl.load(d_ptr + h) * x
    tl.store(out_ptr + (s * heads + h) * p + i, y.to(out_ptr.dtype.element_ty), mask=i < p)


def mamba2_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                        A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                        dt_softplus: bool, state_indices: torch.Tensor | None = None,
                        dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """As `runtime.plugins.recurrent_ops.mamba2_state_update`; the state must be contiguous
    float32."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the Mamba 2 state must be contiguous float32 [slots, H, P, N], got "
                         f"{state.dtype} with strides {state.stride()}")
    seqs, heads, p = x.shape
    groups, n = B.shape[1:]
    dt = mamba2_dt(dt, dt_bias, dt_softplus, dt_limit)
    rows = (state_indices if state_indices is not None
            else torch.arange(seqs, device=x.device)).contiguous()
    out = torch.empty_like(x)
    block_p = min(triton.next_power_of_2(p), 16)
    _mamba2_update_kernel[(seqs, heads, triton.cdiv(p, block_p))](
        state, x.contiguous(), dt.contiguous(), A.float().contiguous(), B.contiguous(),
        C.contiguous(), D.float().contiguous() if D is not None else dt, rows, out, heads,
        groups, p, n, HAS_D=D is not None, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(n))
    return out
