"""Weight-only int8 / int4: quantizers, kernels (reference and torch's CPU ops), method selection,
and whole tiny models against the same model with the dequantized weights written out as floats."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.quantization.cpu import Int4PackKernel, Int8PackKernel
from runtime.quantization.registry import build_quant_config, parse_spec, quantization_methods
from runtime.quantization.weight_only import (
    Int4Config,
    Int4ReferenceKernel,
    Int8Config,
    Int8ReferenceKernel,
    quantize_int4,
    quantize_int8,
)
from runtime import LLM, SamplingParams
from runtime.layers.linear import LinearBase
from tests.parity import PROMPTS

# Logprobs of the quantized model against the dequantized float model, both float32: the only
# difference is the order of accumulation inside the kernels.
LOGPROB_ATOL = 2e-3
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Layer(torch.nn.Module):
    pass


def _kernel_out(kernel, q, x, bias=None):
    layer = _Layer()
    kernel.pack(layer, q)
    return kernel.apply(layer, x, bias), layer


def test_int8_quantizer_error_bound():
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q = quantize_int8(w, torch.float32)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (48,)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_quantizer_error_bound(group_size, symmetric):
    torch.manual_seed(0)
    w = torch.randn(40, 256)
    q = quantize_int4(w, group_size, symmetric, torch.float32)
    assert q.qweight.min() >= 0 and q.qweight.max() <= 15
    assert q.scales.shape == (40, 256 // group_size)
    if symmetric:
        assert (q.zeros == 0).all()
    err = (q.dequantize() - w).abs().view(40, -1, group_size)
    # Round-to-nearest: half a step, plus the clipped top of the symmetric range.
    bound = q.scales[..., None] * (1.0 if symmetric else 0.5) + 1e-5
    assert (err <= bound).all()


@pytest.mark.parametrize("kernel", [Int8ReferenceKernel(), Int8PackKernel()],
                         ids=lambda k: k.name)
def test_int8_kernels_match_dequantized_matmul(kernel):
    torch.manual_seed(0)
    w, x, bias = torch.randn(72, 64), torch.randn(2, 5, 64), torch.randn(72)
    q = quantize_int8(w, torch.float32)
    y, _ = _kernel_out(kernel, q, x, bias)
    ref = torch.nn.functional.linear(x, q.dequantize(), bias)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [Int4ReferenceKernel(), Int4PackKernel()],
                         ids=lambda k: k.name)
@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, False)])
def test_int4_kernels_match_dequantized_matmul(kernel, group_size, symmetric):
    torch.manual_seed(0)
    w, x = torch.randn(80, 256), torch.randn(3, 256)
    q = quantize_int4(w, group_size, symmetric, torch.float32)
    y, _ = _kernel_out(kernel, q, x)
    torch.testing.assert_close(y, x @ q.dequantize().T, atol=1e-4, rtol=1e-4)


def test_int4_cpu_kernel_bf16_activations():
    torch.manual_seed(0)
    w, x = torch.randn(64, 128), torch.randn(4, 128)
    q = quantize_int4(w, 32, False, torch.bfloat16)
    y, _ = _kernel_out(Int4PackKernel(), q, x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x @ q.dequantize().T, atol=0.15, rtol=0.02)


def test_int4_group_size_falls_back_to_a_divisor():
    cfg = Int4Config(group_size=128)
    assert cfg.group_size_for(1536) == 128 and cfg.group_size_for(576) == 64
    assert cfg.quantize(torch.randn(8, 576), torch.float32).group_size == 64
    with pytest.raises(ValueError, match="group size"):
        cfg.group_size_for(80)


def test_registry_and_spec_parsing():
    assert {"int8", "int4"} <= set(quantization_methods())
    assert parse_spec("INT4:group_size=64, symmetric=0") == ("int4",
                                                              {"group_size": "64", "symmetric": "0"})
    cfg = build_quant_config("int4:group_size=32,symmetric=asym", object())
    assert (cfg.group_size, cfg.symmetric) == (32, False)
    assert isinstance(cfg.kernel, Int4ReferenceKernel)  # no hook: the reference kernel
    with pytest.raises(ValueError, match="unknown quantization method"):
        build_quant_config("int3", object())
    with pytest.raises(ValueError, match="group_size"):
        build_quant_config("int4:group_size=48", object())
    assert build_quant_config(None, object()) is None


def test_platform_hook_supplies_the_kernel(monkeypatch):
    from runtime.platforms.cpu.platform import CpuPlatform
    from runtime.quantization.cpu import KERNEL_ENV
    from runtime.plugins.answers import PlatformAnswers
    kernel_for = PlatformAnswers(CpuPlatform()).quantization_kernel
    monkeypatch.setenv(KERNEL_ENV, "native")
    assert isinstance(build_quant_config("int8", object(), kernel_for).kernel, Int8PackKernel)
    assert isinstance(build_quant_config("int4", object(), kernel_for).kernel, Int4PackKernel)
    monkeypatch.setenv(KERNEL_ENV, "reference")  # what an AVX2-only CPU gets by default
    assert isinstance(build_quant_config("int8", object(), kernel_for).kernel, Int8ReferenceKernel)
    assert isinstance(build_quant_config("int4", object(), kernel_for).kernel, Int4ReferenceKernel)
    assert "cpu" in Int8Config.fast_kernel_platforms and "cpu" in Int4Config.fast_kernel_platforms


def _dequantized_copy(src: str, dst: str, config) -> str:
    """The checkpoint at `src`, every linear weight replaced by dequantize(quantize(w))."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, name))
            for key, t in tensors.items():
                if any(f".{part}." in key for part in LINEAR_NAMES):
                    tensors[key] = config.quantize(t, t.dtype).dequantize().to(t.dtype)
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


def _run(path, quantization):
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
              quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    return llm, llm.generate(PROMPTS, params)


def _linear_bytes(llm) -> int:
    model = llm.engine.core.executor.worker.runner.model
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, LinearBase)
               for n, p in m.named_parameters(recurse=False) if n != "bias")


def _linear_shapes(llm) -> list[tuple[int, int]]:
    model = llm.engine.core.executor.worker.runner.model
    return [(m.output_size, m.input_size) for m in model.modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("spec,kernel", [("int8", "native"), ("int8", "reference"),
                                         ("int4:group_size=32,symmetric=1", "native"),
                                         ("int4:group_size=64,symmetric=0", "reference")])
def test_quantized_model_matches_dequantized_model(spec, kernel, tiny_model_factory, tmp_path,
                                                   monkeypatch):
    from runtime.quantization.cpu import KERNEL_ENV
    monkeypatch.setenv(KERNEL_ENV, kernel)
    path = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    config = build_quant_config(spec, object())
    dense = _dequantized_copy(path, str(tmp_path / "dequantized"), config)
    ref_llm, ref = _run(dense, None)
    llm, out = _run(path, spec)
    for i, (a, b) in enumerate(zip(out, ref)):
        sa, sb = a.outputs[0], b.outputs[0]
        assert sa.token_ids == sb.token_ids, f"prompt {i}: greedy tokens differ"
        ours = [next(iter(p.values())).logprob for p in sa.logprobs]
        theirs = [next(iter(p.values())).logprob for p in sb.logprobs]
        assert max(abs(x - y) for x, y in zip(ours, theirs)) < LOGPROB_ATOL
        for pa, pb in zip(a.prompt_logprobs, b.prompt_logprobs):
            if pa is None:
                continue
            (ta, la), (tb, lb) = next(iter(pa.items())), next(iter(pb.items()))
            assert ta == tb and abs(la.logprob - lb.logprob) < LOGPROB_ATOL

    # Resident weight bytes: exactly the packed weights plus float32 scales (and zeros).
    shapes = _linear_shapes(llm)
    if config.name == "int8":
        expected = sum(n * k + 4 * n for n, k in shapes)
    else:
        expected = sum(n * k // 2 + 2 * 4 * n * (k // config.group_size) for n, k in shapes)
    assert _linear_bytes(llm) == expected
    assert _linear_bytes(ref_llm) == sum(4 * n * k for n, k in shapes)
    worker, ref_worker = (x.engine.core.executor.worker for x in (llm, ref_llm))
    assert ref_worker.model_bytes - worker.model_bytes == \
        _linear_bytes(ref_llm) - _linear_bytes(llm)


def test_checkpoint_quantization_config_must_agree(tiny_model_factory, tmp_path):
    path = shutil.copytree(tiny_model_factory("LlamaForCausalLM"), str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "int8"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="int4"):
        LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization="int4")


def test_runtime_plugins_lists_quantization_kernels(capsys, monkeypatch):
    import argparse

    from runtime.quantization.cpu import KERNEL_ENV
    from runtime.cli.plugins_cmd import plugins_command
    monkeypatch.setenv(KERNEL_ENV, "native")
    assert plugins_command(argparse.Namespace(device="cpu", json=False)) == 0
    out = capsys.readouterr().out
    assert "Quantization methods:" in out
    assert "cpu_int8pack_mm (cpu platform)" in out and "gguf_reference (reference)" in out
    monkeypatch.setenv(KERNEL_ENV, "reference")
    plugins_command(argparse.Namespace(device="cpu", json=False))
    assert "int8_reference (reference)" in capsys.readouterr().out
