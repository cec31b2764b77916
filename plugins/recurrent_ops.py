"""The recurrent layer ops of the custom-op contract (`runtime_custom_op`), in portable torch:
causal conv1d, Mamba's selective scan, Mamba 2's SSD scan and the gated delta rule.

They are the reference every platform kernel must match and what runs when no plugin answers.

Conventions shared by every op here:
- Tokens are token-major, as the engine's activations: [T, ...] for the T tokens of a step.
- A prefill op takes a varlen batch: `query_start_loc` [S + 1] int (as the attention metadata's
  query start offsets) cuts the T tokens into S sequences. `initial_state` [S, ...] holds each
  sequence's state before its first token here (None: every sequence starts from zeros) and
  `has_initial_state` [S] bool says which of them carry one (None: all do); a sequence without
  one starts from zeros, whatever its row holds. It returns (out, final_state [S, ...]): the
  state after each sequence's last token, in `initial_state`'s dtype (float32 when None).
- The chunked scans (`mamba2_chunk_scan`, `chunk_gated_delta_rule`) also give the states
  inside a sequence: `checkpoint_rows` [C] int64, sorted rows of the batch, and
  `checkpoint_states` [C, ...] float32, into which the state after each of those rows is
  written (the engine checkpoints the state at block ends this way, for its prefix cache).
- A decode op takes one token per sequence and updates `state` [slots, ...] in place, row
  `state_indices[s]` for sequence s (None: row s).
- Arithmetic is float32; outputs round to the input activations' dtype, states to their own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _spans(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    bounds = query_start_loc.tolist()
    return list(zip(bounds, bounds[1:]))


def _start_state(initial_state: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                 s: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if initial_state is None or (has_initial_state is not None and not has_initial_state[s]):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return initial_state[s].float()


def _final_states(initial_state: torch.Tensor | None, shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """The buffer for the states after each sequence: initial_state's dtype, else float32."""
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    return torch.empty(shape, dtype=dtype, device=device)


def _checkpoints_in(rows: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """(index into `rows`, row) for the checkpoint rows in [lo, hi)."""
    return [(i, r) for i, r in enumerate(rows) if lo <= r < hi]


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal conv1d activation {activation!r}: allowed are 'silu' and None")


# -- causal conv1d (Mamba, Mamba 2, gated delta-net's and LFM2's short convolutions) ---------

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                  has_initial_state: torch.Tensor | None = None, activation: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over each sequence of a varlen batch.

    x [T, dim]; weight [dim, width]; bias [dim] or None; the conv state [S, dim, width - 1]
    holds the width - 1 inputs before a sequence's first token (oldest first). Each output is
    activation(sum_i weight[:, i] * window[i] + bias) over the width inputs ending at it.
    Returns (out [T, dim] in x's dtype, final_state [S, dim, width - 1]).
    """
    width = weight.size(1)
    out = torch.empty_like(x)
    spans = _spans(query_start_loc)
    final = _final_states(initial_state, (len(spans), x.size(1), width - 1), x.device)
    w = weight.float().unsqueeze(1)
    b = bias.float() if bias is not None else None
    for s, (lo, hi) in enumerate(spans):
        start = _start_state(initial_state, has_initial_state, s, (x.size(1), width - 1),
                             x.device)
        window = torch.cat([start, x[lo:hi].float().t()], dim=1)
        y = F.conv1d(window.unsqueeze(0), w, b, groups=x.size(1))[0]
        out[lo:hi] = _activate(y, activation).t().to(x.dtype)
        final[s] = window[:, window.size(1) - (width - 1):].to(final.dtype)
    return out, final


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = None,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: x [S, dim]; state [slots, dim, width - 1], shifted left by one
    in place with x appended. Returns out [S, dim] in x's dtype."""
    rows = state_indices if state_indices is not None else torch.arange(x.size(0),
                                                                        device=x.device)
    window = torch.cat([state[rows].float(), x.float().unsqueeze(-1)], dim=-1)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    state[rows] = window[..., 1:].to(state.dtype)
    return _activate(y, activation).to(x.dtype)


# -- Mamba 1 selective scan --------------------------------------------------------------------

def mamba_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool
             ) -> torch.Tensor:
    """Mamba 1's step sizes as the scan uses them, float32: dt + dt_bias, through softplus
    when `dt_softplus`."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def mamba_out(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None,
              z: torch.Tensor | None) -> torch.Tensor:
    """The scan's output from C . h: plus D x, gated by silu(z), in x's dtype."""
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                   dt_bias: torch.Tensor | None, dt_softplus: bool,
                   query_start_loc: torch.Tensor, initial_state: torch.Tensor | None = None,
                   has_initial_state: torch.Tensor | None = None,
                   checkpoint_rows: torch.Tensor | None = None,
                   checkpoint_states: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba 1's selective scan over a varlen batch.

    x, dt, z [T, d_inner]; A [d_inner, N] (negative: -exp(A_log)); B, C [T, N]; D, dt_bias
    [d_inner]. Per token, with dt' = softplus(dt + dt_bias) when dt_softplus:
    h = exp(dt' A) h + dt' B x;  y = (C . h + D x) * silu(z). State h [S, d_inner, N].
    Returns (y [T, d_inner] in x's dtype, final_state [S, d_inner, N]); with
    `checkpoint_rows` (rows of the batch), the state after each row is written into
    `checkpoint_states` [len(checkpoint_rows), d_inner, N], as `mamba2_chunk_scan` does.
    """
    dt = mamba_dt(dt, dt_bias, dt_softplus)
    A = A.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    spans = _spans(query_start_loc)
    final = _final_states(initial_state, (len(spans), *A.shape), x.device)
    xf, Bf, Cf = x.float(), B.float(), C.float()
    after = {} if checkpoint_rows is None else \
        {r: i for i, r in enumerate(checkpoint_rows.tolist())}
    for s, (lo, hi) in enumerate(spans):
        h = _start_state(initial_state, has_initial_state, s, tuple(A.shape), x.device)
        for t in range(lo, hi):
            h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * xf[t])[:, None] * Bf[t]
            y[t] = h @ Cf[t]
            if t in after:
                checkpoint_states[after[t]] = h
        final[s] = h.to(final.dtype)
    return mamba_out(y, x, D, z), final


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, dt_softplus: bool,
                           state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence of `selective_scan`: x, dt, z [S, d_inner]; B, C [S, N];
    state [slots, d_inner, N] updated in place. Returns y [S, d_inner] in x's dtype."""
    rows = state_indices if state_indices is not None else torch.arange(x.size(0),
                                                                        device=x.device)
    dt = mamba_dt(dt, dt_bias, dt_softplus)
    h = state[rows].float()
    h = torch.exp(dt[..., None] * A.float()) * h + (dt * x.float())[..., None] * B.float()[:, None]
    state[rows] = h.to(state.dtype)
    return mamba_out((h @ C.float().unsqueeze(-1)).squeeze(-1), x, D, z)


# -- Mamba 2 SSD -------------------------------------------------------------------------------

def mamba2_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
              dt_limit: tuple[float, float]) -> torch.Tensor:
    """Mamba 2's step sizes as the scan uses them, float32: clamp(softplus(dt + dt_bias))."""
    return mamba_dt(dt, dt_bias, dt_softplus).clamp(dt_limit[0], dt_limit[1])


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., groups, N] -> [..., heads, N]: each group serves heads // groups consecutive heads."""
    return t.float().repeat_interleave(heads // t.size(-2), dim=-2)


def _decays(cumulative: torch.Tensor) -> torch.Tensor:
    """[H, L] cumulative log decays -> [H, L, L]: exp(c_i - c_j) for j <= i, else 0."""
    diff = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)
    causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=diff.device).tril()
    return diff.masked_fill(~causal, float("-inf")).exp()


def _ssd_state_at(h: torch.Tensor, cum: torch.Tensor, B: torch.Tensor, xdt: torch.Tensor,
                  j: int) -> torch.Tensor:
    """The state after row j of a chunk, from h [H, P, N] before it: decayed to j, plus the
    inputs (x dt) B^T of its rows up to j (B [l, H, N], xdt [l, H, P])."""
    to_j = (cum[:, j:j + 1] - cum[:, :j + 1]).exp()  # [H, j + 1]
    # two operands: a three-operand einsum here was most of a prefill's cost
    return h * cum[:, j].exp()[:, None, None] + torch.einsum(
        "jhp,jhn->hpn", xdt[:j + 1] * to_j.t().unsqueeze(-1), B[:j + 1])


def mamba2_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      dt_softplus: bool, query_start_loc: torch.Tensor,
                      initial_state: torch.Tensor | None = None,
                      has_initial_state: torch.Tensor | None = None, chunk_size: int = 256,
                      dt_limit: tuple[float, float] = (0.0, float("inf")),
                      checkpoint_rows: torch.Tensor | None = None,
                      checkpoint_states: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba 2's state-space duality scan over a varlen batch, chunk by chunk.

    x [T, H, P]; dt [T, H]; A [H] (negative); B, C [T, G, N] (G groups, H % G == 0); D,
    dt_bias [H]. Per token, with dt' = clamp(softplus(dt + dt_bias), *dt_limit):
    h = exp(dt' A) h + dt' x B^T;  y = h C + D x. State h [S, H, P, N].
    Within a chunk the quadratic (attention-like) form, between chunks the recurrence.
    Returns (y [T, H, P] in x's dtype, final_state [S, H, P, N]).
    """
    heads, head_dim, n = x.size(1), x.size(2), B.size(-1)
    dt = mamba2_dt(dt, dt_bias, dt_softplus, dt_limit)
    dA = dt * A.float()
    xdt = x.float() * dt.unsqueeze(-1)
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    spans = _spans(query_start_loc)
    final = _final_states(initial_state, (len(spans), heads, head_dim, n), x.device)
    rows = [] if checkpoint_rows is None else checkpoint_rows.tolist()
    for s, (lo, hi) in enumerate(spans):
        h = _start_state(initial_state, has_initial_state, s, (heads, head_dim, n), x.device)
        for c in range(lo, hi, chunk_size):
            e = min(c + chunk_size, hi)
            cum = dA[c:e].t().cumsum(-1)  # [H, l]
            scores = torch.einsum("ihn,jhn->hij", Ch[c:e], Bh[c:e]) * _decays(cum)
            y_diag = torch.einsum("hij,jhp->ihp", scores, xdt[c:e])
            y_off = torch.einsum("ihn,hpn->ihp", Ch[c:e], h) * cum.t().exp().unsqueeze(-1)
            y[c:e] = y_diag + y_off
            for i, r in _checkpoints_in(rows, c, e):
                checkpoint_states[i] = _ssd_state_at(h, cum, Bh[c:e], xdt[c:e], r - c)
            h = _ssd_state_at(h, cum, Bh[c:e], xdt[c:e], e - c - 1)
        final[s] = h.to(final.dtype)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), final


def mamba2_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                        A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                        dt_softplus: bool, state_indices: torch.Tensor | None = None,
                        dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """One token per sequence of `mamba2_chunk_scan`: x [S, H, P]; dt [S, H]; B, C [S, G, N];
    state [slots, H, P, N] updated in place. Returns y [S, H, P] in x's dtype."""
    rows = state_indices if state_indices is not None else torch.arange(x.size(0),
                                                                        device=x.device)
    heads = x.size(1)
    dt = mamba2_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)
    h = state[rows].float() * torch.exp(dt * A.float())[..., None, None]
    h = h + (x.float() * dt.unsqueeze(-1)).unsqueeze(-1) * Bh.unsqueeze(-2)
    state[rows] = h.to(state.dtype)
    y = (h @ Ch.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


# -- gated delta rule (Qwen3-Next, Qwen3.5, Kimi-style gated delta-nets) -----------------------

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gdn_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_qk_l2norm: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, K] -> float32 [..., Hv, K], each key head serving Hv // Hk consecutive
    value heads, L2-normed if asked, q times the scale (K ** -0.5 by default)."""
    repeat = v.size(-2) // k.size(-2)
    q, k = (t.float().repeat_interleave(repeat, dim=-2) for t in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (scale if scale is not None else q.size(-1) ** -0.5), k


def _gdn_state_at(state: torch.Tensor, cum: torch.Tensor, k: torch.Tensor, u: torch.Tensor,
                  j: int) -> torch.Tensor:
    """The state after row j of a chunk, from `state` before it: decayed to j, plus the
    writes u [H, l, V] of keys k [H, l, K] up to j."""
    to_j = (cum[:, j:j + 1] - cum[:, :j + 1]).exp().unsqueeze(-1)  # [H, j + 1, 1]
    return state * cum[:, j].exp()[:, None, None] + (k[:, :j + 1] * to_j).transpose(-1, -2) \
        @ u[:, :j + 1]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, query_start_loc: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           has_initial_state: torch.Tensor | None = None,
                           use_qk_l2norm: bool = False, scale: float | None = None,
                           chunk_size: int = 64, checkpoint_rows: torch.Tensor | None = None,
                           checkpoint_states: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a varlen batch, chunk by chunk (flash-linear-attention's
    `chunk_gated_delta_rule`).

    q, k [T, Hk, K]; v [T, Hv, V] (Hv % Hk == 0); g [T, Hv] log decays (<= 0); beta [T, Hv].
    Per token and value head, with state S [K, V]:
    S = exp(g) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q.
    State [S, Hv, K, V], float32 as transformers keeps it.
    Returns (o [T, Hv, V] in v's dtype, final_state [S, Hv, K, V]).
    """
    q, k = _gdn_inputs(q, k, v, use_qk_l2norm, scale)
    vf, g, beta = v.float(), g.float(), beta.float()
    heads, dk, dv = vf.size(1), k.size(-1), vf.size(-1)
    o = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    spans = _spans(query_start_loc)
    final = _final_states(initial_state, (len(spans), heads, dk, dv), v.device)
    rows = [] if checkpoint_rows is None else checkpoint_rows.tolist()
    for s, (lo, hi) in enumerate(spans):
        state = _start_state(initial_state, has_initial_state, s, (heads, dk, dv), v.device)
        for c in range(lo, hi, chunk_size):
            e = min(c + chunk_size, hi)
            qc, kc, vc = (t[c:e].transpose(0, 1) for t in (q, k, vf))  # [H, l, *]
            bc = beta[c:e].t().unsqueeze(-1)  # [H, l, 1]
            cum = g[c:e].t().cumsum(-1)  # [H, l]
            decay = _decays(cum)
            # The values each token writes, u, solve (I + A) u = beta (v - exp(G) S0^T k)
            # with A strictly lower: A[i, j] = beta_i exp(G_i - G_j) k_i . k_j.
            system = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
            system = system + torch.eye(e - c, device=v.device)
            rhs = bc * (vc - cum.exp().unsqueeze(-1) * (kc @ state))
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            o[c:e] = (cum.exp().unsqueeze(-1) * (qc @ state)
                      + ((qc @ kc.transpose(-1, -2)) * decay) @ u).transpose(0, 1)
            for i, r in _checkpoints_in(rows, c, e):
                checkpoint_states[i] = _gdn_state_at(state, cum, kc, u, r - c)
            state = _gdn_state_at(state, cum, kc, u, e - c - 1)
        final[s] = state.to(final.dtype)
    return o.to(v.dtype), final


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                     state_indices: torch.Tensor | None = None,
                                     use_qk_l2norm: bool = False,
                                     scale: float | None = None) -> torch.Tensor:
    """One token per sequence of `chunk_gated_delta_rule` (flash-linear-attention's
    `fused_recurrent_gated_delta_rule` for decode): q, k [S, Hk, K]; v [S, Hv, V]; g, beta
    [S, Hv]; state [slots, Hv, K, V] updated in place. Returns o [S, Hv, V] in v's dtype."""
    rows = state_indices if state_indices is not None else torch.arange(v.size(0),
                                                                        device=v.device)
    q, k = _gdn_inputs(q, k, v, use_qk_l2norm, scale)
    h = state[rows].float() * g.float().exp()[..., None, None]
    delta = beta.float().unsqueeze(-1) * (v.float() - (k.unsqueeze(-1) * h).sum(-2))
    h = h + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state[rows] = h.to(state.dtype)
    return (q.unsqueeze(-1) * h).sum(-2).to(v.dtype)


# op name -> portable op: the names platforms answer in `runtime_custom_op`
OPS = {"causal_conv1d": causal_conv1d, "causal_conv1d_update": causal_conv1d_update,
       "selective_scan": selective_scan, "selective_state_update": selective_state_update,
       "mamba2_chunk_scan": mamba2_chunk_scan, "mamba2_state_update": mamba2_state_update,
       "chunk_gated_delta_rule": chunk_gated_delta_rule,
       "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule}
