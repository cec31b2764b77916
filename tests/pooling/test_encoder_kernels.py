"""The CPU encoder kernels against torch: packed variable-length attention (MiniLM's head size,
strided q/k/v as slices of a fused qkv output), erf GELU and the residual add fused into
LayerNorm, in float32 and bfloat16."""
import pytest
import torch
import torch.nn.functional as F

from runtime.platforms.cpu import kernels
from runtime.platforms.cpu.platform import CpuPlatform

BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
pytestmark = pytest.mark.skipif(BUILD_ERROR is not None,
                                reason=f"the CPU kernels did not build: {BUILD_ERROR}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_attention_on_packed_sequences(dtype, causal):
    torch.manual_seed(0)
    lens, heads, head_size, scale = [3, 130, 1, 33, 16], 12, 32, 32 ** -0.5
    starts = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    qkv = torch.randn(sum(lens), 3 * heads * head_size).to(dtype)
    q, k, v = (x.view(-1, heads, head_size) for x in qkv.chunk(3, dim=-1))
    out = torch.ops.runtime_cpu.encoder_attention(q, k, v, starts, max(lens), scale, causal)
    for i, n in enumerate(lens):
        rows = slice(starts[i], starts[i + 1])
        ref = F.scaled_dot_product_attention(*(x[rows].float().transpose(0, 1)
                                               for x in (q, k, v)),
                                             is_causal=causal, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_gelu_matches_torch(dtype):
    x = (torch.randn(37, 1536) * 3).to(dtype)
    torch.testing.assert_close(torch.ops.runtime_cpu.gelu(x), F.gelu(x), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_add_layer_norm_matches_torch(dtype):
    x, residual = (torch.randn(37, 384) * 4 + 1).to(dtype), torch.randn(37, 384).to(dtype)
    weight, bias = torch.randn(384).to(dtype), torch.randn(384).to(dtype)
    want = F.layer_norm(x + residual, (384,), weight, bias, 1e-12)
    got = torch.ops.runtime_cpu.add_layer_norm(x, residual, weight, bias, 1e-12)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
