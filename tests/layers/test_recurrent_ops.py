"""The portable recurrent ops against transformers' own torch paths for the same math, per
sequence of a varlen batch at odd lengths, with and without initial states; then chunked
prefill (a sequence in two pieces, the state carried) and prefill-then-decode against one run."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba import modeling_mamba as hf_mamba
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.qwen3_next import modeling_qwen3_next as hf_gdn

from runtime.plugins import recurrent_ops as ops

LENS = [1, 7, 13, 70]  # 70 crosses a 64-token chunk and leaves an odd tail
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
DTYPES = list(TOL)


def _loc(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _with_states(lens, shape):
    """Initial states for some sequences, zeros (and a flag off) for the others."""
    initial = torch.randn(len(lens), *shape)
    has = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    return initial, has


# -- causal conv1d ----------------------------------------------------------------------------

def _conv_inputs(dtype, dim=24, width=4, lens=LENS):
    x = torch.randn(sum(lens), dim).to(dtype)
    weight, bias = torch.randn(dim, width).to(dtype), torch.randn(dim).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_prefill_matches_transformers(dtype, activation):
    x, weight, bias = _conv_inputs(dtype)
    initial, has = _with_states(LENS, (24, 3))
    out, final = ops.causal_conv1d(x, weight, bias, _loc(LENS), initial, has, activation)
    for s, (lo, hi) in enumerate(zip(_loc(LENS)[:-1].tolist(), _loc(LENS)[1:].tolist())):
        seq = x[lo:hi].t().unsqueeze(0)
        if has[s]:  # transformers' update takes a state and any number of tokens
            state = initial[s:s + 1].to(dtype).clone()
            want = hf_mamba2.causal_conv1d_update(seq, state, weight, bias, activation)
            _close(final[s], state[0], dtype)
        else:
            want = hf_mamba2.causal_conv1d_fn(seq, weight, bias, activation)
            _close(final[s], F.pad(seq[0], (3, 0))[:, -3:], dtype)
        _close(out[lo:hi], want[0].t(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_update_matches_transformers(dtype):
    x, weight, bias = _conv_inputs(dtype, lens=[5])
    state = torch.randn(8, 24, 3).to(dtype)
    rows = torch.tensor([6, 0, 3, 1, 7])
    want_state = state[rows].clone()
    want = hf_gdn.causal_conv1d_update(x.unsqueeze(-1), want_state, weight, bias, "silu")
    got = ops.causal_conv1d_update(x, state, weight, bias, "silu", rows)
    _close(got, want[..., 0], dtype)
    _close(state[rows], want_state, dtype)


def test_causal_conv1d_chunks_and_decode_equal_one_run():
    x, weight, bias = _conv_inputs(torch.float32, lens=[11])
    whole, whole_state = ops.causal_conv1d(x, weight, bias, _loc([11]), activation="silu")
    first, state = ops.causal_conv1d(x[:2], weight, bias, _loc([2]), activation="silu")
    second, state = ops.causal_conv1d(x[2:9], weight, bias, _loc([7]), state, None, "silu")
    steps = [ops.causal_conv1d_update(x[t:t + 1], state, weight, bias, "silu") for t in (9, 10)]
    _close(torch.cat([first, second, *steps]), whole, torch.float32)
    _close(state, whole_state, torch.float32)


# -- Mamba 1 ----------------------------------------------------------------------------------

def _mamba_inputs(dtype, tokens, d=16, n=8):
    x, dt, z = (torch.randn(tokens, d).to(dtype) for _ in range(3))
    A = -torch.rand(d, n) - 0.2
    B, C = (torch.randn(tokens, n).to(dtype) for _ in range(2))
    D, dt_bias = torch.randn(d), torch.randn(d) * 0.5
    return x, dt, A, B, C, D, z, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_scan_matches_transformers(dtype):
    lens = [1, 6, 13]
    x, dt, A, B, C, D, z, dt_bias = _mamba_inputs(dtype, sum(lens))
    y, final = ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, True, _loc(lens))
    loc = _loc(lens).tolist()
    for s, (lo, hi) in enumerate(zip(loc, loc[1:])):
        cols = [t[lo:hi].t().unsqueeze(0) for t in (x, dt, B, C, z)]
        want, want_state = hf_mamba.mamba_selective_scan(
            cols[0].float(), cols[1].float(), A, cols[2].float(), cols[3].float(), D,
            cols[4].float(), dt_bias, True, return_last_state=True)
        _close(y[lo:hi], want[0].t(), dtype)
        _close(final[s], want_state[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_state_update_matches_transformers(dtype):
    x, dt, A, B, C, D, z, dt_bias = _mamba_inputs(dtype, 3)
    state = torch.randn(3, 16, 8)
    want_state = state.clone()
    want = hf_mamba.mamba_selective_state_update(want_state, x.float(), dt.float(), A,
                                                 B.float(), C.float(), D, z=z.float(),
                                                 dt_bias=dt_bias, dt_softplus=True)
    got = ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True)
    _close(got, want, dtype)
    _close(state, want_state, dtype)


def test_selective_scan_chunks_and_decode_equal_one_run():
    x, dt, A, B, C, D, z, dt_bias = _mamba_inputs(torch.float32, 9)
    whole, whole_state = ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, True, _loc([9]))
    part = lambda lo, hi: (x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, z[lo:hi])
    first, state = ops.selective_scan(*part(0, 3), dt_bias, True, _loc([3]))
    second, state = ops.selective_scan(*part(3, 8), dt_bias, True, _loc([5]), state)
    last = ops.selective_state_update(state, *part(8, 9), dt_bias, True)
    _close(torch.cat([first, second, last]), whole, torch.float32)
    _close(state, whole_state, torch.float32)


# -- Mamba 2 ----------------------------------------------------------------------------------

def _ssd_inputs(dtype, tokens, heads=4, p=8, groups=2, n=16):
    x = torch.randn(tokens, heads, p).to(dtype)
    dt = torch.randn(tokens, heads).to(dtype)
    A = -torch.rand(heads) - 0.5
    B, C = (torch.randn(tokens, groups, n).to(dtype) for _ in range(2))
    D, dt_bias = torch.randn(heads), torch.randn(heads) * 0.5
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_chunk_scan_matches_transformers(dtype):
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(dtype, sum(LENS))
    initial, has = _with_states(LENS, (4, 8, 16))
    y, final = ops.mamba2_chunk_scan(x, dt, A, B, C, D, dt_bias, True, _loc(LENS), initial, has,
                                     chunk_size=16)
    loc = _loc(LENS).tolist()
    for s, (lo, hi) in enumerate(zip(loc, loc[1:])):
        start = initial[s:s + 1] if has[s] else None
        want, want_state = hf_mamba2.mamba2_chunk_scan(
            x[lo:hi][None], dt[lo:hi][None].float(), A, B[lo:hi][None], C[lo:hi][None], 16, D=D,
            dt_bias=dt_bias, initial_states=start, dt_softplus=True, return_final_states=True)
        _close(y[lo:hi], want[0], dtype)
        _close(final[s], want_state[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_state_update_matches_transformers(dtype):
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(dtype, 3)
    state = torch.randn(5, 4, 8, 16)
    rows = torch.tensor([4, 0, 2])
    want_state = state[rows].clone()
    expand = lambda t: t[..., None].expand(*t.shape, 8)  # transformers' per-(head, p) layout
    want = hf_mamba2.mamba2_selective_state_update(
        want_state, x.float(), expand(dt.float()), expand(A)[..., None].expand(4, 8, 16),
        B.float(), C.float(), expand(D), expand(dt_bias), True)
    got = ops.mamba2_state_update(state, x, dt, A, B, C, D, dt_bias, True, rows)
    _close(got, want, dtype)
    _close(state[rows], want_state, dtype)


def test_mamba2_chunks_and_decode_equal_one_run():
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(torch.float32, 21)
    whole, whole_state = ops.mamba2_chunk_scan(x, dt, A, B, C, D, dt_bias, True, _loc([21]),
                                               chunk_size=8)
    part = lambda lo, hi: (x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, dt_bias, True)
    first, state = ops.mamba2_chunk_scan(*part(0, 5), _loc([5]), chunk_size=8)
    second, state = ops.mamba2_chunk_scan(*part(5, 20), _loc([15]), state, chunk_size=8)
    last = ops.mamba2_state_update(state, *part(20, 21))
    _close(torch.cat([first, second, last]), whole, torch.float32)
    _close(state, whole_state, torch.float32)


# -- gated delta rule -------------------------------------------------------------------------

def _gdn_inputs(dtype, tokens, k_heads=2, v_heads=4, dk=16, dv=8):
    q, k = (torch.randn(tokens, k_heads, dk).to(dtype) for _ in range(2))
    v = torch.randn(tokens, v_heads, dv).to(dtype)
    g = (-F.softplus(torch.randn(tokens, v_heads))).to(dtype)
    beta = torch.rand(tokens, v_heads).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunk_gated_delta_rule_matches_transformers(dtype, l2norm):
    q, k, v, g, beta = _gdn_inputs(dtype, sum(LENS))
    if not l2norm:  # unnormalised keys make the delta rule diverge: keep them short
        q, k = q / 4, k / 4
    initial, has = _with_states(LENS, (4, 16, 8))
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, _loc(LENS), initial, has, l2norm)
    loc = _loc(LENS).tolist()
    for s, (lo, hi) in enumerate(zip(loc, loc[1:])):
        start = initial[s:s + 1] if has[s] else None
        want, want_state = hf_gdn.torch_chunk_gated_delta_rule(
            *(t[lo:hi][None] for t in (q, k, v, g, beta)), initial_state=start,
            output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        _close(o[lo:hi], want[0], dtype)
        _close(final[s], want_state[0], dtype)
    assert final.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_recurrent_gated_delta_rule_matches_transformers(dtype):
    q, k, v, g, beta = _gdn_inputs(dtype, 3)
    state = torch.randn(6, 4, 16, 8)
    rows = torch.tensor([5, 1, 2])
    want_state = state[rows].clone()
    want, want_state = hf_gdn.torch_recurrent_gated_delta_rule(
        *(t[:, None] for t in (q, k, v, g, beta)), initial_state=want_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, rows, True)
    _close(got, want[:, 0], dtype)
    _close(state[rows], want_state, dtype)


def test_gated_delta_rule_chunks_and_decode_equal_one_run():
    q, k, v, g, beta = _gdn_inputs(torch.float32, 75)
    whole, whole_state = ops.chunk_gated_delta_rule(q, k, v, g, beta, _loc([75]),
                                                    use_qk_l2norm=True)
    part = lambda lo, hi: tuple(t[lo:hi] for t in (q, k, v, g, beta))
    first, state = ops.chunk_gated_delta_rule(*part(0, 9), _loc([9]), use_qk_l2norm=True)
    second, state = ops.chunk_gated_delta_rule(*part(9, 74), _loc([65]), state,
                                               use_qk_l2norm=True)
    last = ops.fused_recurrent_gated_delta_rule(*part(74, 75), state, use_qk_l2norm=True)
    _close(torch.cat([first, second, last]), whole, torch.float32)
    _close(state, whole_state, torch.float32)


def test_unknown_conv_activation_is_refused():
    x, weight, bias = _conv_inputs(torch.float32, lens=[3])
    with pytest.raises(ValueError, match="allowed are 'silu' and None"):
        ops.causal_conv1d(x, weight, bias, _loc([3]), activation="gelu")


def test_every_op_name_is_in_the_hook_contract():
    from runtime.plugins import hookspecs
    contract = hookspecs.runtime_custom_op.__doc__.replace("\n", " ")
    for name in ops.OPS:
        assert f'"{name}"' in contract, name


# -- states inside a sequence (prefix-cache checkpoints) --------------------------------------

CHECKPOINT_LENS = [13, 70]
CHECKPOINT_ROWS = [0, 4, 12, 13 + 15, 13 + 63, 13 + 64, 13 + 69]  # mid-chunk, chunk ends, last


def _prefix_states(run, lens, rows, initial, has):
    """The final state of each sequence cut after each row: what a checkpoint must hold."""
    loc = _loc(lens).tolist()
    states = []
    for r in rows:
        s = max(i for i in range(len(lens)) if loc[i] <= r)
        states.append(run(loc[s], r + 1, initial[s:s + 1], has[s:s + 1]))
    return torch.stack(states)


def test_scans_keep_the_states_after_checkpoint_rows():
    rows = torch.tensor(CHECKPOINT_ROWS)
    total = sum(CHECKPOINT_LENS)
    q, k, v, g, beta = _gdn_inputs(torch.float32, total)
    initial, has = _with_states(CHECKPOINT_LENS, (4, 16, 8))
    kept = torch.empty(len(rows), 4, 16, 8)
    _, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, _loc(CHECKPOINT_LENS), initial, has,
                                          True, checkpoint_rows=rows, checkpoint_states=kept)
    gdn = lambda lo, hi, i, h: ops.chunk_gated_delta_rule(
        *(t[lo:hi] for t in (q, k, v, g, beta)), _loc([hi - lo]), i, h, True)[1][0]
    _close(kept, _prefix_states(gdn, CHECKPOINT_LENS, CHECKPOINT_ROWS, initial, has),
           torch.float32)
    _close(kept[-1], final[-1], torch.float32)

    x, dt, A, B, C, D, dt_bias = _ssd_inputs(torch.float32, total)
    initial, has = _with_states(CHECKPOINT_LENS, (4, 8, 16))
    kept = torch.empty(len(rows), 4, 8, 16)
    ops.mamba2_chunk_scan(x, dt, A, B, C, D, dt_bias, True, _loc(CHECKPOINT_LENS), initial, has,
                          chunk_size=16, checkpoint_rows=rows, checkpoint_states=kept)
    ssd = lambda lo, hi, i, h: ops.mamba2_chunk_scan(
        x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, dt_bias, True, _loc([hi - lo]), i, h,
        chunk_size=16)[1][0]
    _close(kept, _prefix_states(ssd, CHECKPOINT_LENS, CHECKPOINT_ROWS, initial, has),
           torch.float32)


def test_conv_states_at_rows_equal_the_final_states_of_prefixes():
    from runtime.layers.recurrent_state import conv_states_at
    x, weight, bias = _conv_inputs(torch.float32, lens=CHECKPOINT_LENS)
    initial, has = _with_states(CHECKPOINT_LENS, (24, 3))
    got = conv_states_at(x, initial, has, _loc(CHECKPOINT_LENS), torch.tensor(CHECKPOINT_ROWS))
    conv = lambda lo, hi, i, h: ops.causal_conv1d(x[lo:hi], weight, bias, _loc([hi - lo]), i,
                                                  h)[1][0]
    _close(got, _prefix_states(conv, CHECKPOINT_LENS, CHECKPOINT_ROWS, initial, has),
           torch.float32)
