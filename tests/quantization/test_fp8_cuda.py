"""FP8 w8a8 through torch._scaled_mm on a CUDA GPU of compute capability 8.9+ (skipped elsewhere;
the CPU-side checks of the same kernel are in test_checkpoint_formats.py)."""
from __future__ import annotations

import pytest
import torch

from runtime.quantization.fp8 import Fp8ReferenceKernel, Fp8ScaledMMKernel, Fp8Weight, quantize_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with fp8 matmuls (compute capability 8.9+)")


class _Layer(torch.nn.Module):
    pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_matches_dequantized_matmul(dtype, static):
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda")
    x = torch.randn(5, 512, device="cuda")  # a token count that is not a multiple of 16
    q = quantize_fp8(w)
    if static:
        q = Fp8Weight(q.qweight, q.scales, x.abs().max() / 448)
    layer = _Layer()
    Fp8ScaledMMKernel().pack(layer, q)
    ref = x @ q.dequantize().T
    y = Fp8ScaledMMKernel().apply(layer, x.to(dtype))
    assert y.dtype == dtype and y.shape == ref.shape
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.06
    torch.testing.assert_close(Fp8ReferenceKernel().apply(layer, x), ref, atol=1e-3, rtol=1e-3)


def test_engine_picks_scaled_mm_and_matches_dequantized(tiny_model_factory):
    from runtime import LLM, SamplingParams
    from runtime.layers.linear import LinearBase
    path = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    llm = LLM(path, dtype="bfloat16", quantization="fp8", kv_cache_memory="64MiB")
    model = llm.engine.core.executor.worker.runner.model
    kernels = {type(m.method.kernel).__name__ for m in model.modules()
               if isinstance(m, LinearBase)}
    assert kernels == {"Fp8ScaledMMKernel"}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[1, 504, 3458, 282], [1, 9690, 28, 2683, 253]], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
