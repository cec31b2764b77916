"""The CPU platform's bf16/fp16 paths against float32 references at half-precision tolerances:
the dense kernel's packed oneDNN weights (also with oneDNN held to older ISAs, which it picks at
run time) and the fused element-wise kernels on the row counts of prefill and decode steps."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from runtime.layers.rotary import rotary_embedding
from runtime.platforms.cpu import kernels, ops
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.plugins.ops import add_rms_norm, rms_norm, silu_and_mul

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
needs_kernels = pytest.mark.skipif(BUILD_ERROR is not None,
                                   reason=f"the CPU kernels did not build: {BUILD_ERROR}")


def check_dense(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias = (torch.randn(96, 40) * 0.2).to(dtype), torch.randn(96).to(dtype)
    dense = ops.linear(weight)
    x = torch.randn(rows, 40).to(dtype)
    for b in (bias, None):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = dense(x, b)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_dense_kernel_in_half_precision(dtype, rows):
    check_dense(dtype, rows)


def test_bf16_weights_are_packed_where_onednn_computes_bf16():
    packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    products = ops.dense_products(torch.randn(8, 4).bfloat16()).products()
    assert (products <= {"onednn", "dense"}) == packs


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_dense_kernel_under_an_older_onednn_isa(isa):
    script = ("import torch; from tests.platforms.test_cpu_bf16_ops import check_dense\n"
              "for rows in (1, 64, 300): check_dense(torch.bfloat16, rows)\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr


# Kernel outputs within one unit of the dtype's last place of the portable op's (float32: exp's).
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@needs_kernels
@pytest.mark.parametrize("dtype", list(ELEMENTWISE_TOL))
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("hidden", [576, 48])  # 36 AVX-512 registers a row, and 3
def test_norms_on_decode_and_prefill_rows(dtype, rows, hidden):
    torch.manual_seed(rows + hidden)
    x, r = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    w = (1 + torch.randn(hidden) * 0.1).to(dtype)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(torch.ops.runtime_cpu.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5),
                               atol=tol, rtol=tol)
    got_out, got_sum = torch.ops.runtime_cpu.add_rms_norm(x, r, w, 1e-5)
    want_out, want_sum = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # one rounding, as torch's add
    torch.testing.assert_close(got_out, want_out, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", list(ELEMENTWISE_TOL))
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_silu_and_mul_on_decode_and_prefill_rows(dtype, rows):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 3072) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, -0.0])  # exp's clamps
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(torch.ops.runtime_cpu.silu_and_mul(x), silu_and_mul(x),
                               atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", list(ELEMENTWISE_TOL))
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full, partial (one register per half)
def test_rotary_on_decode_and_prefill_rows(dtype, rows, rotary_dim):
    torch.manual_seed(rows + rotary_dim)
    q, k = torch.randn(rows, 9 * 64).to(dtype), torch.randn(rows, 3 * 64).to(dtype)
    positions, cache = torch.randint(0, 4096, (rows,)), torch.randn(4096, rotary_dim)
    want_q, want_k = rotary_embedding(positions, q.clone(), k.clone(), cache, 64)
    torch.ops.runtime_cpu.rotary_embedding(positions, q, k, cache, 64)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)


def test_bf16_engine_follows_transformers_in_bf16(tiny_model_factory):
    """The packed products and the 16-lane kernels together, in a model whose shapes they all
    take (head size 64): transformers' greedy tokens in bf16 over the first steps (later ones
    may part on near-ties, as two bf16 implementations do), logprobs within bf16 noise."""
    import transformers

    from runtime import LLM, SamplingParams
    from tests.parity import PROMPTS, hf_greedy
    steps = 4
    path = tiny_model_factory("LlamaForCausalLM", hidden_size=128, intermediate_size=256,
                              num_attention_heads=2, num_key_value_heads=1)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    references = [hf_greedy(hf, p, steps) for p in PROMPTS]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0)
    for out, (tokens, logprobs) in zip(llm.generate(PROMPTS, params), references):
        sample = out.outputs[0]
        assert sample.token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 0.15
