"""The Triton causal conv1d and Mamba 1 scan kernels against the portable ops.

Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before anything imports Triton); on a GPU the same tests compile them for real. Sequences of
1, 2, 5 and 13 tokens, channel counts that are not powers of two, sizes tiny for the interpreter.
"""
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

from runtime.platforms.cuda import conv_scan_triton  # noqa: E402
from runtime.plugins import recurrent_ops as portable  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
LENGTHS = [1, 13, 2, 5]
LOC = torch.tensor([0, 1, 14, 16, 21], device=DEVICE)
T = 21


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def _has(initial):
    return torch.tensor([True, False, True, True], device=DEVICE) if initial else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("width,bias,activation", [(4, True, "silu"), (3, False, None)])
def test_causal_conv1d(dtype, initial, width, bias, activation):
    dim = 40  # one partial block of channels
    x = torch.randn(2 * T, dim, device=DEVICE).to(dtype)[::2]  # strided rows, as a chunk gives
    weight = torch.randn(dim, width, device=DEVICE).to(dtype)
    b = torch.randn(dim, device=DEVICE).to(dtype) if bias else None
    init = torch.randn(4, dim, width - 1, device=DEVICE).to(dtype) if initial else None
    want, want_final = portable.causal_conv1d(x, weight, b, LOC, init, _has(initial),
                                              activation)
    got, final = conv_scan_triton.causal_conv1d(x, weight, b, LOC, init, _has(initial),
                                                activation)
    _close(got, want, dtype)
    assert final.dtype == want_final.dtype
    _close(final, want_final, dtype)


def test_causal_conv1d_over_several_channel_and_token_blocks():
    x = torch.randn(70, 72, device=DEVICE)  # 72 channels: two blocks; 69 tokens: three blocks
    weight, init = torch.randn(72, 4, device=DEVICE), torch.randn(2, 72, 3, device=DEVICE)
    loc = torch.tensor([0, 1, 70], device=DEVICE)
    want, want_final = portable.causal_conv1d(x, weight, None, loc, init, None, "silu")
    got, final = conv_scan_triton.causal_conv1d(x, weight, None, loc, init, None, "silu")
    _close(got, want, torch.float32)
    _close(final, want_final, torch.float32)


def _scan_inputs(dtype, dim=20, n=12, tokens=T):
    x, dt, z = (torch.randn(tokens, dim, device=DEVICE).to(dtype) for _ in range(3))
    bc = torch.randn(tokens, 3 * n, device=DEVICE).to(dtype)  # B, C as split views
    A = -torch.rand(dim, n, device=DEVICE) - 0.5
    D, dt_bias = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE)
    return x, dt, A, bc[:, n:2 * n], bc[:, 2 * n:], D, z, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("initial,gated", [(True, True), (False, False)])
def test_selective_scan(dtype, initial, gated):
    x, dt, A, B, C, D, z, dt_bias = _scan_inputs(dtype)
    if not gated:  # no softplus: step sizes as a caller gives them, positive
        D = z = dt_bias = None
        dt = dt.abs()
    init = torch.randn(4, *A.shape, device=DEVICE) if initial else None
    # inside the 13-token sequence, the end of the 1-token one, the ends of the last two
    rows = torch.tensor([0, 3, 8, 13, 15, 20], device=DEVICE)
    want_ck, got_ck = (torch.zeros(6, *A.shape, device=DEVICE) for _ in range(2))
    want, want_final = portable.selective_scan(x, dt, A, B, C, D, z, dt_bias, gated, LOC, init,
                                               _has(initial), rows, want_ck)
    got, final = conv_scan_triton.selective_scan(x, dt, A, B, C, D, z, dt_bias, gated, LOC,
                                                 init, _has(initial), rows, got_ck)
    _close(got, want, dtype)
    _close(final, want_final, torch.float32)
    _close(got_ck, want_ck, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_state_update(dtype):
    x, dt, A, B, C, D, z, dt_bias = _scan_inputs(dtype, dim=36, tokens=3)  # 36: three blocks
    state = torch.randn(5, *A.shape, device=DEVICE)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    want_state = state.clone()
    want = portable.selective_state_update(want_state, x, dt, A, B, C, D, z, dt_bias, True,
                                           rows)
    got = conv_scan_triton.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True,
                                                  rows)
    _close(got, want, dtype)
    _close(state, want_state, torch.float32)


def test_a_state_or_checkpoint_buffer_the_kernel_does_not_take_is_refused():
    x, dt, A, B, C, D, z, dt_bias = _scan_inputs(torch.float32, tokens=1)
    state = torch.zeros(1, *A.shape, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous float32"):
        conv_scan_triton.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True)
    loc, rows = torch.tensor([0, 1], device=DEVICE), torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="contiguous float32"):
        conv_scan_triton.selective_scan(x, dt, A, B, C, D, z, dt_bias, True, loc,
                                        checkpoint_rows=rows, checkpoint_states=state)


@pytest.mark.parametrize("name", ["causal_conv1d", "selective_scan", "selective_state_update"])
def test_the_kernels_keep_the_portable_signatures(name):
    assert (inspect.signature(getattr(conv_scan_triton, name))
            == inspect.signature(portable.OPS[name]))


def test_the_cuda_platform_answers_the_conv_and_mamba_ops_with_the_kernels():
    from runtime.platforms.cuda.platform import CudaPlatform, GpuDevice
    platform = CudaPlatform([GpuDevice(0, "H100", (9, 0), 80 << 30)])
    for name in ("causal_conv1d", "selective_scan", "selective_state_update"):
        assert platform.custom_op(name) is getattr(conv_scan_triton, name)
