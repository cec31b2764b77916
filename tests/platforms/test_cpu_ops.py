"""The CPU platform's fused layer ops against the portable ones, on the shapes models give them."""
import pytest
import torch

from runtime.platforms.cpu import kernels, ops
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.plugins.ops import add_rms_norm, gated_rms_norm, rms_norm, silu_and_mul
from runtime.layers.rotary import rotary_embedding

BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
pytestmark = pytest.mark.skipif(BUILD_ERROR is not None,
                                reason=f"the CPU kernels did not build: {BUILD_ERROR}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rotary_dim", [64, 32, 24])  # full, partial, and a fallback size
def test_rotary_on_slices_of_a_fused_qkv_output(dtype, rotary_dim):
    tokens, heads, kv_heads, head_size = 9, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    positions = torch.tensor([0, 1, 2, 7, 100, 101, 5, 63, 64])
    cache = torch.randn(128, rotary_dim)
    want_q, want_k = rotary_embedding(positions, q.clone(), k.clone(), cache, head_size)
    got_q, got_k = ops.rotary_embedding(positions, q, k, cache, head_size)
    tol = TOL[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOL))
def test_norms_and_activation(dtype):
    x, r, w = (torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype),
               torch.randn(576).to(dtype))
    tol = TOL[dtype]
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    torch.testing.assert_close(ops.add_rms_norm(x, r, w, 1e-5), add_rms_norm(x, r, w, 1e-5),
                               atol=tol, rtol=tol)
    g = torch.randn(5, 3072).to(dtype) * 4
    torch.testing.assert_close(ops.silu_and_mul(g), silu_and_mul(g), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("norm_before_gate, group, shared", [
    (False, 128, False), (False, 512, False),  # Mamba 2's groups (one group: the whole row)
    (True, 64, True), (True, 128, True)])      # a delta-net's heads, one weight for all
def test_gated_rms_norm_on_a_gate_sliced_from_a_projection(dtype, norm_before_gate, group,
                                                           shared):
    rows, width = 7, 512
    projected = (torch.randn(rows, 2 * width + 40) * 3).to(dtype)
    gate = projected[:, :width]  # rows 2 * width + 40 apart, as the in_proj split gives it
    x = torch.randn(rows, width).to(dtype)
    w = torch.randn(group if shared else width).to(dtype)
    assert gate.stride(0) != width
    got = ops.gated_rms_norm(x, gate, w, 1e-6, group, norm_before_gate)
    want = gated_rms_norm(x, gate, w, 1e-6, group, norm_before_gate)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_gated_rms_norm_portable_op_rounds_as_the_layers_reference():
    """transformers' MambaRMSNormGated (norm after the gate, over groups) and RMSNormGated
    (per head, norm before the gate), written out in bf16."""
    x, g = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    h = (x.float() * torch.nn.functional.silu(g.float())).view(5, 2, 32)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).view(5, 64)
    assert torch.equal(gated_rms_norm(x, g, w, 1e-6, 32, False), w * h.bfloat16())
    wh = w[:16]
    xf = x.float().view(5, 4, 16)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (wh * xf.bfloat16() * torch.nn.functional.silu(g.float().view(5, 4, 16))).bfloat16()
    assert torch.equal(gated_rms_norm(x, g, wh, 1e-6, 16, True), want.view(5, 64))


def test_shapes_the_kernels_do_not_take_use_the_portable_ops():
    x, w = torch.randn(3, 4, 20), torch.randn(20)  # 20 is not a multiple of 8
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    strided = torch.randn(3, 4, 64)[:, :, :32]
    torch.testing.assert_close(ops.rms_norm(strided, w[:1].expand(32).contiguous(), 1e-6),
                               rms_norm(strided, w[:1].expand(32).contiguous(), 1e-6))
    g = torch.randn(3, 24)  # halves of 12
    torch.testing.assert_close(ops.silu_and_mul(g), silu_and_mul(g))
    x, w = torch.randn(3, 40), torch.randn(40)  # groups of 20
    torch.testing.assert_close(ops.gated_rms_norm(x, g[:, :1].expand(3, 40), w, 1e-6, 20, True),
                               gated_rms_norm(x, g[:, :1].expand(3, 40), w, 1e-6, 20, True))


@pytest.mark.parametrize("rows", [1, 2, 64, 256, 300])  # MKL, oneDNN, oneDNN, oneDNN, MKL
def test_dense_kernel_matches_f_linear(rows, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # oneDNN packs for 2+ threads
    weight, bias = torch.randn(96, 40), torch.randn(96)
    dense = ops.linear(weight)
    x = torch.randn(rows, 40)
    torch.testing.assert_close(dense(x, bias), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense(x, None), x @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 8, 15, 16, 17, 31, 32, 33, 49152, 1000])
def test_greedy_argmax_is_the_first_maximum(n, dtype):
    torch.manual_seed(n)
    x = torch.randn(7, n).to(dtype)
    x[1] = 0.0  # all tied: the first
    x[2, n // 2:] = x[2].max() + 1  # tied maxima from the middle: the first of them
    x[3, -1] = float("nan")  # NaN above all
    x[4, n // 3] = float("nan")
    x[4, -1] = float("nan")  # the first NaN
    x[5] = float("-inf")
    got = ops.greedy_argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.max(dim=-1).indices.tolist()
    strided = torch.randn(4, 2 * n).to(dtype)[:, :n]  # rows not adjacent
    assert ops.greedy_argmax(strided).tolist() == strided.max(dim=-1).indices.tolist()
