"""A SmolLM2 step on the CPU platform runs every norm, activation and attention in the platform's
kernels: no portable op (aten's norm pieces, activations, SDPA) is left on the hot path."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from runtime import LLM, SamplingParams
from tests.platforms.test_cpu_bf16_ops import BUILD_ERROR

PORTABLE_OPS = {"aten::rms_norm", "aten::_fused_rms_norm", "aten::pow", "aten::rsqrt",
                "aten::layer_norm", "aten::native_layer_norm", "aten::silu", "aten::silu_",
                "aten::sigmoid", "aten::gelu", "aten::scaled_dot_product_attention"}


@pytest.mark.skipif(BUILD_ERROR is not None, reason=f"the CPU kernels did not build: {BUILD_ERROR}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_smollm2_step_calls_no_portable_op(dtype):
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("bf16 is not native on this CPU")
    llm = LLM(dtype=dtype, kv_cache_memory="64MiB", max_model_len=256, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time, in a land far away"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # prefill, then decode steps
        llm.generate(prompts, params, use_tqdm=False)
    names = {event.key for event in prof.key_averages()}
    assert {"runtime_cpu::add_rms_norm", "runtime_cpu::silu_and_mul",
            "runtime_cpu::encoder_attention", "runtime_cpu::paged_attention_decode"} <= names
    assert not names & PORTABLE_OPS, sorted(names & PORTABLE_OPS)
