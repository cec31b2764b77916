"""The CPU platform's recurrent kernels (csrc/recurrent_ops.cpp) against the portable ops, on
varlen batches at odd lengths, with initial states on some sequences, in float32 and bfloat16."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from runtime.platforms.cpu import kernels, ops
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.plugins import kda_ops as portable_kda
from runtime.plugins import recurrent_ops as portable

BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
pytestmark = pytest.mark.skipif(BUILD_ERROR is not None,
                                reason=f"the CPU kernels did not build: {BUILD_ERROR}")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
LENS = [1, 9, 70, 3]
LOC = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
HAS = torch.tensor([True, False, True, True])
SCAN_LENS = [1, 5, 37, 300]  # the prefill scans' batch: 343 tokens
SCAN_LOC = torch.tensor([0, *torch.tensor(SCAN_LENS).cumsum(0).tolist()])
# prefix-cache checkpoints: the ends of the first three sequences and of the batch, rows inside
SCAN_ROWS = torch.tensor([0, 3, 5, 20, 42, 100, 255, 342])


def _close(got, want, dtype, scale=0.0):
    """`scale`: the size of the terms a result sums, where cancellation leaves small results
    with float32 rounding of that size."""
    torch.testing.assert_close(got.float(), want.float(),
                               atol=TOL[dtype] + TOL[torch.float32] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d(dtype, activation):
    x = torch.randn(sum(LENS), 96).to(dtype)[:, 24:72]  # a slice of a projection's output
    weight, bias = torch.randn(48, 4).to(dtype), torch.randn(48).to(dtype)
    initial = torch.randn(len(LENS), 48, 3)
    kept = initial.clone()
    got = ops.causal_conv1d(x, weight, bias, LOC, initial, HAS, activation)
    want = portable.causal_conv1d(x, weight, bias, LOC, initial, HAS, activation)
    for g, w in zip(got, want):
        _close(g, w, dtype)
    assert torch.equal(initial, kept)  # the caller's states are not written


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("state_dtype", ["float32", "model"])
def test_causal_conv1d_update(dtype, state_dtype):
    x, weight = torch.randn(5, 32).to(dtype), torch.randn(32, 4).to(dtype)
    state = torch.randn(7, 32, 3).to(torch.float32 if state_dtype == "float32" else dtype)
    rows = torch.tensor([6, 0, 2, 5, 1])
    want_state = state.clone()
    want = portable.causal_conv1d_update(x, want_state, weight, None, "silu", rows)
    got = ops.causal_conv1d_update(x, state, weight, None, "silu", rows)
    _close(got, want, dtype)
    _close(state, want_state, dtype)


def _gdn(dtype, tokens, k_heads=2, v_heads=4, dk=32, dv=32):
    q, k = (torch.randn(tokens, k_heads, dk).to(dtype) for _ in range(2))
    v = torch.randn(tokens, v_heads, dv).to(dtype)
    g = -F.softplus(torch.randn(tokens, v_heads))
    return q, k, v, g, torch.rand(tokens, v_heads).to(dtype)


@pytest.mark.parametrize("dtype", list(TOL))
def test_chunk_gated_delta_rule(dtype):
    inputs = _gdn(dtype, sum(LENS))
    initial = torch.randn(len(LENS), 4, 32, 32)
    kept = initial.clone()
    rows = torch.tensor([0, 1, 10, 25, 79, 80, 82])  # prefix-cache checkpoints
    got_kept, want_kept = torch.empty(len(rows), 4, 32, 32), torch.empty(len(rows), 4, 32, 32)
    got = ops.chunk_gated_delta_rule(*inputs, LOC, initial, HAS, use_qk_l2norm=True,
                                     checkpoint_rows=rows, checkpoint_states=got_kept)
    want = portable.chunk_gated_delta_rule(*inputs, LOC, initial, HAS, use_qk_l2norm=True,
                                           checkpoint_rows=rows, checkpoint_states=want_kept)
    for g, w in zip((*got, got_kept), (*want, want_kept)):
        _close(g, w, dtype)
    assert torch.equal(initial, kept)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("l2norm", [True, False])
def test_fused_recurrent_gated_delta_rule(dtype, l2norm):
    q, k, v, g, beta = _gdn(dtype, 3)
    if not l2norm:
        q, k = q / 6, k / 6
    state = torch.randn(5, 4, 32, 32)
    rows = torch.tensor([4, 0, 2])
    want_state = state.clone()
    want = portable.fused_recurrent_gated_delta_rule(q, k, v, g, beta, want_state, rows, l2norm,
                                                     scale=0.3)
    got = ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, rows, l2norm, scale=0.3)
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
def test_mamba2_state_update(dtype):
    x = torch.randn(3, 4, 8).to(dtype)
    dt, A = torch.randn(3, 4).to(dtype), -torch.rand(4) - 0.5
    B, C = (torch.randn(3, 2, 16).to(dtype) for _ in range(2))
    D, dt_bias = torch.randn(4), torch.randn(4)
    state = torch.randn(6, 4, 8, 16)
    rows = torch.tensor([5, 3, 0])
    want_state = state.clone()
    want = portable.mamba2_state_update(want_state, x, dt, A, B, C, D, dt_bias, True, rows,
                                        (0.0, 3.0))
    got = ops.mamba2_state_update(state, x, dt, A, B, C, D, dt_bias, True, rows, (0.0, 3.0))
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


def _mamba2(dtype, tokens, groups, heads=4, p=22, n=32):
    """p 22: a full and a partial block of 16 state rows per head, the partial one not a whole
    number of the kernel's register tiles."""
    x, dt = torch.randn(tokens, heads, p).to(dtype), torch.randn(tokens, heads).to(dtype)
    B, C = (torch.randn(tokens, groups, n).to(dtype) for _ in range(2))
    return x, dt, -torch.rand(heads) - 0.5, B, C, torch.randn(heads), torch.randn(heads)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("initial", [True, False])
# 32-256: the prefill's register tiles, a row in one tile or (AVX2, 128 and 256) in several
@pytest.mark.parametrize("n", [32, 64, 128, 256])
def test_mamba2_chunk_scan(dtype, groups, initial, n):
    x, dt, A, B, C, D, dt_bias = _mamba2(dtype, sum(SCAN_LENS), groups, n=n)
    states = torch.randn(4, 4, 22, n) if initial else None
    has = torch.tensor([True, False, True, True]) if initial else None
    kept, want_kept = (torch.zeros(len(SCAN_ROWS), 4, 22, n) for _ in range(2))
    limit = (0.0, 2.0) if groups == 2 else (0.0, float("inf"))
    want = portable.mamba2_chunk_scan(x, dt, A, B, C, D, dt_bias, True, SCAN_LOC, states, has,
                                      64, limit, SCAN_ROWS, want_kept)
    got = ops.mamba2_chunk_scan(x, dt, A, B, C, D, dt_bias, True, SCAN_LOC, states, has, 64,
                                limit, SCAN_ROWS, kept)
    _close(got[0], want[0], dtype, scale=float(want[0].abs().max()))
    _close(got[1], want[1], torch.float32)
    _close(kept, want_kept, torch.float32)


def _kda(dtype, tokens, heads=2, dk=32, dv=48):
    q, k = (torch.randn(tokens, heads, dk).to(dtype) for _ in range(2))
    v = torch.randn(tokens, heads, dv).to(dtype)
    g = -F.softplus(torch.randn(tokens, heads, dk))
    return q, k, v, g, torch.rand(tokens, heads).to(dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("initial", [True, False])
def test_chunk_kda(dtype, initial):
    inputs = _kda(dtype, sum(SCAN_LENS))
    states = torch.randn(4, 2, 32, 48) if initial else None
    has = torch.tensor([False, True, True, True]) if initial else None
    kept, want_kept = torch.zeros(len(SCAN_ROWS), 2, 32, 48), torch.zeros(len(SCAN_ROWS), 2, 32, 48)
    want = portable_kda.chunk_kda(*inputs, SCAN_LOC, states, has, SCAN_ROWS, want_kept)
    got = ops.chunk_kda(*inputs, SCAN_LOC, states, has, SCAN_ROWS, kept)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], torch.float32)
    _close(kept, want_kept, torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
def test_fused_recurrent_kda(dtype):
    q, k, v, g, beta = _kda(dtype, 3)
    state = torch.randn(5, 2, 32, 48)
    rows = torch.tensor([4, 0, 2])
    want_state = state.clone()
    want = portable_kda.fused_recurrent_kda(q, k, v, g, beta, want_state, rows)
    got = ops.fused_recurrent_kda(q, k, v, g, beta, state, rows)
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


def _mamba1(dtype, tokens, dim=40, n=16):
    x, dt, z = (torch.randn(tokens, dim).to(dtype) for _ in range(3))
    A = -torch.rand(dim, n) - 0.5
    B, C = (torch.randn(tokens, n).to(dtype) for _ in range(2))
    return x, dt, A, B, C, torch.randn(dim), z, torch.randn(dim)


@pytest.mark.parametrize("dtype", list(TOL))
def test_selective_scan(dtype):
    """40 channels: two work items per sequence, the second a partial block."""
    x, dt, A, B, C, D, z, dt_bias = _mamba1(dtype, sum(LENS))
    initial = torch.randn(4, 40, 16)
    rows = torch.tensor([0, 5, 12, 60, 82])  # the ends of some rows, two in one sequence
    want_kept, kept = torch.zeros(5, 40, 16), torch.zeros(5, 40, 16)
    want, want_final = portable.selective_scan(x, dt, A, B, C, D, z, dt_bias, True, LOC,
                                               initial, HAS, rows, want_kept)
    got, final = ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, True, LOC, initial, HAS,
                                    rows, kept)
    _close(got, want, dtype)
    _close(final, want_final, torch.float32)
    _close(kept, want_kept, torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
def test_selective_state_update(dtype):
    x, dt, A, B, C, D, z, dt_bias = _mamba1(dtype, 3)
    state = torch.randn(6, 40, 16)
    rows = torch.tensor([5, 3, 0])
    want_state = state.clone()
    want = portable.selective_state_update(want_state, x, dt, A, B, C, D, z, dt_bias, True,
                                           rows)
    got = ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, rows)
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


def test_shapes_the_kernels_do_not_take_use_the_portable_ops():
    q, k, v, g, beta = _gdn(torch.float32, 2, dv=12)  # 12 is not a multiple of 16
    state = torch.randn(2, 4, 32, 12)
    want_state = state.clone()
    want = portable.fused_recurrent_gated_delta_rule(q, k, v, g, beta, want_state)
    torch.testing.assert_close(ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state),
                               want)
    torch.testing.assert_close(state, want_state)


def test_the_platform_answers_the_recurrent_ops_with_their_signatures():
    platform = CpuPlatform()
    for name, portable_op in {**portable.OPS, **portable_kda.OPS}.items():
        assert platform.custom_op(name) is getattr(ops, name)
        assert inspect.signature(getattr(ops, name)) == inspect.signature(portable_op)
