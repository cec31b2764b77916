"""The Triton recurrent decode kernels against the portable ops.

Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before anything imports Triton); on a GPU the same tests compile them for real. Sizes stay tiny:
the interpreter runs each program in numpy.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

from runtime.platforms.cuda import recurrent_triton  # noqa: E402
from runtime.plugins import recurrent_ops as portable  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("dk,dv", [(16, 16), (24, 40)])  # head sizes not powers of two too
def test_fused_recurrent_gated_delta_rule(dtype, l2norm, dk, dv):
    q, k = (torch.randn(3, 2, dk, device=DEVICE).to(dtype) / (1 if l2norm else 4)
            for _ in range(2))
    v = torch.randn(3, 4, dv, device=DEVICE).to(dtype)
    g = -F.softplus(torch.randn(3, 4, device=DEVICE))
    beta = torch.rand(3, 4, device=DEVICE).to(dtype)
    state = torch.randn(5, 4, dk, dv, device=DEVICE)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    want_state = state.clone()
    want = portable.fused_recurrent_gated_delta_rule(q, k, v, g, beta, want_state, rows, l2norm)
    got = recurrent_triton.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, rows,
                                                            l2norm)
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,bias,activation", [(4, True, "silu"), (3, False, None)])
def test_causal_conv1d_update(dtype, width, bias, activation):
    x = torch.randn(3, 40, device=DEVICE).to(dtype)
    weight = torch.randn(40, width, device=DEVICE).to(dtype)
    b = torch.randn(40, device=DEVICE).to(dtype) if bias else None
    state = torch.randn(4, 40, width - 1, device=DEVICE).to(dtype)
    rows = torch.tensor([3, 1, 0], device=DEVICE)
    want_state = state.clone()
    want = portable.causal_conv1d_update(x, want_state, weight, b, activation, rows)
    got = recurrent_triton.causal_conv1d_update(x, state, weight, b, activation, rows)
    _close(got, want, dtype)
    _close(state, want_state, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_d", [True, False])
def test_mamba2_state_update(dtype, with_d):
    x = torch.randn(3, 4, 24, device=DEVICE).to(dtype)  # 24 head dims: two blocks, one partial
    dt = torch.randn(3, 4, device=DEVICE).to(dtype)
    A = -torch.rand(4, device=DEVICE) - 0.5
    B, C = (torch.randn(3, 2, 12, device=DEVICE).to(dtype) for _ in range(2))
    D = torch.randn(4, device=DEVICE) if with_d else None
    dt_bias = torch.randn(4, device=DEVICE)
    state = torch.randn(5, 4, 24, 12, device=DEVICE)
    rows = torch.tensor([4, 1, 3], device=DEVICE)
    want_state = state.clone()
    want = portable.mamba2_state_update(want_state, x, dt, A, B, C, D, dt_bias, True, rows,
                                        (0.0, 2.0))
    got = recurrent_triton.mamba2_state_update(state, x, dt, A, B, C, D, dt_bias, True, rows,
                                               (0.0, 2.0))
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


def test_a_state_the_kernel_does_not_take_is_refused():
    q = k = torch.randn(1, 1, 16, device=DEVICE)
    v, g = torch.randn(1, 1, 16, device=DEVICE), torch.zeros(1, 1, device=DEVICE)
    state = torch.zeros(1, 1, 16, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous float32"):
        recurrent_triton.fused_recurrent_gated_delta_rule(q, k, v, g, g, state)


@pytest.mark.parametrize("name", ["fused_recurrent_gated_delta_rule", "causal_conv1d_update",
                                  "mamba2_state_update"])
def test_the_kernels_keep_the_portable_signatures(name):
    assert (inspect.signature(getattr(recurrent_triton, name))
            == inspect.signature(portable.OPS[name]))


def test_the_cuda_platform_answers_the_decode_ops_with_the_kernels():
    from runtime.platforms.cuda.platform import CudaPlatform, GpuDevice
    platform = CudaPlatform([GpuDevice(0, "H100", (9, 0), 80 << 30)])
    for name in ("causal_conv1d_update", "fused_recurrent_gated_delta_rule",
                 "mamba2_state_update"):
        assert platform.custom_op(name) is getattr(recurrent_triton, name)
