"""Kimi delta attention (KDA, Kimi Linear): the gated delta rule with a decay per key channel
instead of per head, as portable torch ops (custom ops `chunk_kda` / `fused_recurrent_kda`,
which a platform may answer).

Per token and head, with state S [K, V] (float32) and g [K] log decays:
S = diag(exp(g)) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q, q and k L2-normed (eps 1e-6,
as flash-linear-attention) and q scaled by K ** -0.5. The prefill op runs the recurrence
token by token (a chunked form needs flash-linear-attention's sub-chunked decays to stay
finite); it takes `checkpoint_rows` as the chunked gated delta rule does.
"""
from __future__ import annotations

import torch

from runtime.plugins.recurrent_ops import (_checkpoints_in, _final_states, _l2norm, _spans,
                                           _start_state)


def _kda_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * q.size(-1) ** -0.5, k


def _kda_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of states [..., H, K, V]: (o [..., H, V], the new state)."""
    state = state * g.exp().unsqueeze(-1)
    delta = beta.unsqueeze(-1) * (v - (k.unsqueeze(-1) * state).sum(-2))
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-1) * state).sum(-2), state


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, query_start_loc: torch.Tensor,
              initial_state: torch.Tensor | None = None,
              has_initial_state: torch.Tensor | None = None,
              checkpoint_rows: torch.Tensor | None = None,
              checkpoint_states: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a varlen batch: q, k [T, H, K]; v [T, H, V]; g [T, H, K] (<= 0); beta [T, H].
    Returns (o [T, H, V] in v's dtype, final_state [S, H, K, V])."""
    q, k = _kda_inputs(q, k)
    vf, g, beta = v.float(), g.float(), beta.float()
    heads, dk, dv = vf.size(1), k.size(-1), vf.size(-1)
    o = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    spans = _spans(query_start_loc)
    final = _final_states(initial_state, (len(spans), heads, dk, dv), v.device)
    rows = [] if checkpoint_rows is None else checkpoint_rows.tolist()
    for s, (lo, hi) in enumerate(spans):
        state = _start_state(initial_state, has_initial_state, s, (heads, dk, dv), v.device)
        kept = dict((r, i) for i, r in _checkpoints_in(rows, lo, hi))
        for t in range(lo, hi):
            o[t], state = _kda_step(state, q[t], k[t], vf[t], g[t], beta[t])
            if t in kept:
                checkpoint_states[kept[t]] = state
        final[s] = state.to(final.dtype)
    return o.to(v.dtype), final


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor,
                        state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence of `chunk_kda` (decode): q, k [S, H, K]; v [S, H, V]; g
    [S, H, K]; beta [S, H]; state [slots, H, K, V] updated in place at `state_indices` (None:
    rows 0 .. S - 1). Returns o [S, H, V] in v's dtype."""
    rows = state_indices if state_indices is not None else torch.arange(v.size(0),
                                                                        device=v.device)
    q, k = _kda_inputs(q, k)
    o, h = _kda_step(state[rows].float(), q, k, v.float(), g.float(), beta.float())
    state[rows] = h.to(state.dtype)
    return o.to(v.dtype)


# op name -> portable op: the names platforms answer in `runtime_custom_op`
OPS = {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}
