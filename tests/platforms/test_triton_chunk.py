"""The Triton chunked prefill kernels (Mamba 2's SSD scan, the gated delta rule) against the
portable ops.

Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before anything imports Triton); on a GPU the same tests compile them for real. Sizes stay tiny:
the interpreter runs each program in numpy. The batch holds sequences of 1, 3, 17 and 40 tokens,
so the chunks walked are whole, partial and single rows; the checkpoint rows fall inside chunks
and at chunk and sequence ends.
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

from runtime.platforms.cuda import chunk_triton  # noqa: E402
from runtime.plugins import recurrent_ops as portable  # noqa: E402

LENGTHS = (1, 3, 17, 40)
# with chunks of 16: row 19 ends seq 2's first chunk, 36 and 52 end seq 3's, 0, 3, 20 and 60
# end sequences, 2, 9 and 45 lie inside chunks
CHECKPOINT_ROWS = (0, 2, 3, 9, 19, 20, 36, 45, 52, 60)


def _batch():
    qsl = torch.tensor((0,) + LENGTHS, device=DEVICE).cumsum(0).to(torch.int32)
    rows = torch.tensor(CHECKPOINT_ROWS, device=DEVICE)
    return qsl, rows, int(qsl[-1])


def _initial(start, shape):
    """(initial_state, has_initial_state): random rows, the second sequence's ignored."""
    if not start:
        return None, None
    has = torch.tensor([True, False, True, True], device=DEVICE)
    return torch.randn(len(LENGTHS), *shape, device=DEVICE), has


def _close(got, want, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,groups,start,chunk_size", [
    (torch.float32, 1, True, 16), (torch.float32, 2, False, 16), (torch.float32, 2, True, 7),
    (torch.bfloat16, 2, True, 16)])
def test_mamba2_chunk_scan(dtype, groups, start, chunk_size):
    qsl, rows, tokens = _batch()
    heads, p, n = 4, 40, 12  # 40 head dims: two blocks, one partial; 12 state dims: padded
    x = torch.randn(tokens, heads, p, device=DEVICE).to(dtype)
    dt = torch.randn(tokens, heads, device=DEVICE).to(dtype)
    A = -torch.rand(heads, device=DEVICE) - 0.5
    B, C = (torch.randn(tokens, groups, n, device=DEVICE).to(dtype) / 2 for _ in range(2))
    D, dt_bias = torch.randn(heads, device=DEVICE), torch.randn(heads, device=DEVICE)
    initial, has = _initial(start, (heads, p, n))
    kept = [torch.zeros(len(rows), heads, p, n, device=DEVICE) for _ in range(2)]
    args = (x, dt, A, B, C, D, dt_bias, True, qsl, initial, has, chunk_size, (0.01, 1.5))
    want, want_final = portable.mamba2_chunk_scan(*args, checkpoint_rows=rows,
                                                  checkpoint_states=kept[0])
    got, got_final = chunk_triton.mamba2_chunk_scan(*args, checkpoint_rows=rows,
                                                    checkpoint_states=kept[1])
    assert got.dtype == dtype and got_final.dtype == torch.float32
    _close(got, want, dtype)
    _close(got_final, want_final, dtype)
    _close(kept[1], kept[0], dtype)


def test_mamba2_chunk_scan_without_d_or_checkpoints():
    qsl, _, tokens = _batch()
    x = torch.randn(tokens, 2, 16, device=DEVICE)
    dt = torch.rand(tokens, 2, device=DEVICE) / 4
    A = -torch.rand(2, device=DEVICE)
    B, C = (torch.randn(tokens, 1, 16, device=DEVICE) / 2 for _ in range(2))
    initial = torch.randn(len(LENGTHS), 2, 16, 16, device=DEVICE).to(torch.bfloat16)
    args = (x, dt, A, B, C, None, None, False, qsl, initial)
    want, want_final = portable.mamba2_chunk_scan(*args, chunk_size=32)
    got, got_final = chunk_triton.mamba2_chunk_scan(*args, chunk_size=32)
    assert got_final.dtype == torch.bfloat16  # the states keep the initial states' dtype
    _close(got, want, torch.float32)
    _close(got_final, want_final, torch.bfloat16)


@pytest.mark.parametrize("dtype,l2norm,start,chunk_size", [
    (torch.float32, True, True, 16), (torch.float32, False, False, 16),
    (torch.float32, True, True, 7), (torch.bfloat16, True, True, 16)])
def test_chunk_gated_delta_rule(dtype, l2norm, start, chunk_size):
    qsl, rows, tokens = _batch()
    k_heads, v_heads, dk, dv = 1, 2, 24, 40  # 40 value columns: two blocks, one partial
    q, k = (torch.randn(tokens, k_heads, dk, device=DEVICE).to(dtype) / (1 if l2norm else 5)
            for _ in range(2))
    v = torch.randn(tokens, v_heads, dv, device=DEVICE).to(dtype)
    g = -F.softplus(torch.randn(tokens, v_heads, device=DEVICE))
    beta = torch.rand(tokens, v_heads, device=DEVICE).to(dtype)
    initial, has = _initial(start, (v_heads, dk, dv))
    kept = [torch.zeros(len(rows), v_heads, dk, dv, device=DEVICE) for _ in range(2)]
    args = (q, k, v, g, beta, qsl, initial, has, l2norm, None, chunk_size, rows)
    want, want_final = portable.chunk_gated_delta_rule(*args, checkpoint_states=kept[0])
    got, got_final = chunk_triton.chunk_gated_delta_rule(*args, checkpoint_states=kept[1])
    assert got.dtype == dtype
    _close(got, want, dtype)
    _close(got_final, want_final, dtype)
    _close(kept[1], kept[0], dtype)


def test_checkpoint_states_the_kernel_cannot_write_are_refused():
    qsl, rows, tokens = _batch()
    q = k = torch.randn(tokens, 1, 16, device=DEVICE)
    v, g = torch.randn(tokens, 1, 16, device=DEVICE), torch.zeros(tokens, 1, device=DEVICE)
    kept = torch.zeros(len(rows), 1, 16, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous float32"):
        chunk_triton.chunk_gated_delta_rule(q, k, v, g, g, qsl, checkpoint_rows=rows,
                                            checkpoint_states=kept)


@pytest.mark.parametrize("name", ["mamba2_chunk_scan", "chunk_gated_delta_rule"])
def test_the_kernels_keep_the_portable_signatures(name):
    assert (inspect.signature(getattr(chunk_triton, name))
            == inspect.signature(portable.OPS[name]))


def test_the_cuda_platform_answers_the_chunked_scans_with_the_kernels():
    from runtime.platforms.cuda.platform import CudaPlatform, GpuDevice
    platform = CudaPlatform([GpuDevice(0, "H100", (9, 0), 80 << 30)])
    for name in ("mamba2_chunk_scan", "chunk_gated_delta_rule"):
        assert platform.custom_op(name) is getattr(chunk_triton, name)
