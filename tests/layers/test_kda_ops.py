"""Kimi delta attention's portable ops against transformers' own torch paths
(`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`), per sequence of a varlen
batch with and without initial states, and the states they keep after checkpoint rows."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kda

from runtime.plugins import kda_ops as ops
from tests.layers.test_recurrent_ops import _close, _loc, _prefix_states, _with_states

LENS = [1, 7, 70]
HEADS, DIM = 2, 16


def _inputs(dtype, tokens):
    q, k, v = (torch.randn(tokens, HEADS, DIM).to(dtype) for _ in range(3))
    g = -F.softplus(torch.randn(tokens, HEADS, DIM)).to(dtype)  # a decay per key channel
    return q, k, v, g, torch.rand(tokens, HEADS).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kda_matches_transformers(dtype):
    q, k, v, g, beta = _inputs(dtype, sum(LENS))
    initial, has = _with_states(LENS, (HEADS, DIM, DIM))
    o, final = ops.chunk_kda(q, k, v, g, beta, _loc(LENS), initial, has)
    loc = _loc(LENS).tolist()
    for s, (lo, hi) in enumerate(zip(loc, loc[1:])):
        want, want_state = hf_kda.chunk_kimi_delta_attention(
            *(t[lo:hi][None] for t in (q, k, v)), g=g[lo:hi][None], beta=beta[lo:hi][None],
            initial_state=initial[s:s + 1] if has[s] else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        _close(o[lo:hi], want[0], dtype)
        _close(final[s], want_state[0], dtype)


def test_fused_recurrent_kda_matches_transformers():
    q, k, v, g, beta = _inputs(torch.float32, 3)
    state = torch.randn(5, HEADS, DIM, DIM)
    rows = torch.tensor([4, 0, 2])
    want, want_state = hf_kda.recurrent_kimi_delta_attention(
        *(t[:, None] for t in (q, k, v)), g=g[:, None], beta=beta[:, None],
        initial_state=state[rows].clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    got = ops.fused_recurrent_kda(q, k, v, g, beta, state, rows)
    _close(got, want[:, 0], torch.float32)
    _close(state[rows], want_state, torch.float32)


def test_chunk_kda_keeps_the_states_after_checkpoint_rows():
    lens, rows = [13, 30], [0, 4, 12, 13 + 15, 13 + 29]
    q, k, v, g, beta = _inputs(torch.float32, sum(lens))
    initial, has = _with_states(lens, (HEADS, DIM, DIM))
    kept = torch.empty(len(rows), HEADS, DIM, DIM)
    ops.chunk_kda(q, k, v, g, beta, _loc(lens), initial, has, torch.tensor(rows), kept)
    run = lambda lo, hi, i, h: ops.chunk_kda(*(t[lo:hi] for t in (q, k, v, g, beta)),
                                             _loc([hi - lo]), i, h)[1][0]
    _close(kept, _prefix_states(run, lens, rows, initial, has), torch.float32)
