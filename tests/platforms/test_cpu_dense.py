"""The CPU kernels' dense product (float32; bfloat16 where the CPU has AVX512-BF16) against
float64 torch, across its tiles' edges."""
import pytest
import torch
import torch.nn.functional as F

from runtime.platforms.cpu import kernels, ops
from runtime.platforms.cpu.platform import CpuPlatform

BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
pytestmark = pytest.mark.skipif(BUILD_ERROR is not None,
                                reason=f"the CPU kernels did not build: {BUILD_ERROR}")


def dense(x, weight, bias=None):
    packed = torch.ops.runtime_cpu.pack_dense_weight(weight)
    return torch.ops.runtime_cpu.dense(x, packed, weight.size(0), bias)


# rows: each register tile's height (1-6 on AVX2, 1-12 on AVX-512), the 120-row block's edge;
# in_features: one K slice (AVX2; two on AVX-512), its edge, three with a short last one;
# out_features: under one panel, a panel, a ragged last panel.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 64, 119, 120, 121, 250])
@pytest.mark.parametrize("in_features,out_features", [(8, 3), (256, 16), (257, 40),
                                                      (576, 100), (600, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_matches_float64(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = dense(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5 * in_features ** 0.5, rtol=1e-5)


BF16 = pytest.mark.skipif(BUILD_ERROR is not None or not torch.ops.runtime_cpu.dense_takes_bf16(),
                          reason="`dense` takes bfloat16 only where the CPU has AVX512-BF16")


# rows: the AVX-512 tile's height (12) and its edges too; in_features: one bf16 K slice (256),
# two with a short last one; out_features: under one 32-wide panel, a ragged last panel.
@BF16
@pytest.mark.parametrize("rows", [1, 2, 3, 11, 12, 13, 64, 121])
@pytest.mark.parametrize("in_features,out_features", [(8, 3), (256, 32), (576, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_dense_matches_float64(rows, in_features, out_features, with_bias):
    """Float32 sums of exact bf16 products, rounded once: within an ulp of bf16 of the float64
    product of the same bf16 values."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = dense(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=1e-4 * in_features ** 0.5, rtol=2 ** -8)


@BF16
def test_bf16_dense_refuses_an_odd_in_features():
    with pytest.raises(RuntimeError, match="even in_features, got 33"):
        torch.ops.runtime_cpu.pack_dense_weight(torch.randn(20, 33).bfloat16())
    packed = torch.ops.runtime_cpu.pack_dense_weight(torch.randn(20, 32).bfloat16())
    with pytest.raises(RuntimeError, match="packed weight's dtype"):
        torch.ops.runtime_cpu.dense(torch.randn(4, 32), packed, 20, None)


@BF16
def test_a_bf16_layer_of_odd_in_features_takes_onednn():
    """`dense` cannot take it, whatever the choice of the reference shape says."""
    products = ops.dense_products(torch.randn(64, 33).bfloat16()).products()
    assert "dense" not in products


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_dense_is_the_same_on_any_thread_count(threads):
    generator = torch.Generator().manual_seed(threads)
    x = torch.randn(70, 300, generator=generator)
    weight = torch.randn(530, 300, generator=generator)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dense(x, weight)
        torch.set_num_threads(threads)
        assert torch.equal(dense(x, weight), one)  # each output has one summation order
    finally:
        torch.set_num_threads(before)


def test_no_rows_give_an_empty_product():
    assert dense(torch.randn(0, 32), torch.randn(20, 32)).shape == (0, 20)


def test_wrong_inputs_are_refused_with_the_reason():
    weight = torch.randn(20, 32)
    packed = torch.ops.runtime_cpu.pack_dense_weight(weight)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.runtime_cpu.dense(torch.randn(4, 31), packed, 20, None)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        torch.ops.runtime_cpu.dense(torch.randn(4, 32), packed, 40, None)
    with pytest.raises(RuntimeError, match="contiguous 2-D input"):
        torch.ops.runtime_cpu.dense(torch.randn(32, 4).T, packed, 20, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.runtime_cpu.dense(torch.randn(4, 32), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="2-D float32 weight"):
        torch.ops.runtime_cpu.pack_dense_weight(weight.double())
    with pytest.raises(RuntimeError, match="takes a float32 weight"):
        torch.ops.runtime_cpu.dense(torch.randn(4, 32).half(), packed.half(), 20, None)
