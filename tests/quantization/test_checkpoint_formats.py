"""Pre-quantized checkpoints (FP8, compressed-tensors FP8 / MXFP4 / NVFP4, GPTQ, AWQ) and FP8 at
load: each written in the format's on-disk layout from a tiny random Llama, loaded by the engine,
and run against the same model with the weights the checkpoint stands for written as float32."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.plugins.manager import get_plugin_manager
from runtime.quantization.awq import unpack_awq
from runtime.quantization.fp4 import unpack_e2m1
from runtime.quantization.fp8 import Fp8ReferenceKernel, Fp8ScaledMMKernel, quantize_fp8
from runtime.quantization.packed_int4 import unpack_int32
from runtime.quantization.registry import build_quant_config
from runtime import LLM, SamplingParams
from runtime.layers.linear import LinearBase
from tests.parity import PROMPTS
from tests.quantization import formats

# Logprobs against the dequantized float32 model: both run float32 activations, so the only
# difference is the order of accumulation (and, for GPTQ/AWQ, zero points folded into the int4
# form as scale * (8 - zero), one float32 rounding).
LOGPROB_ATOL = 2e-3
GROUP = 32


class _Layer(torch.nn.Module):
    pass


def test_unpacking_orders():
    nibbles = torch.tensor([[0x76543210]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(nibbles).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]  # GPTQ: lowest first
    assert unpack_awq(nibbles).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]  # AWQ's interleaved order
    packed = torch.tensor([[0x21, 0xF9]], dtype=torch.uint8)  # low nibble is the first element
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, -0.5, -6.0]]


def test_fp8_kernels_match_dequantized_matmul():
    torch.manual_seed(0)
    w, x, bias = torch.randn(48, 64), torch.randn(2, 3, 64), torch.randn(48)
    q = quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scales.shape == (48,)
    assert ((q.dequantize() - w).abs() <= w.abs() / 16 + 1e-6).all()  # e4m3: 3 mantissa bits
    ref = torch.nn.functional.linear(x, q.dequantize(), bias)
    layer = _Layer()
    Fp8ReferenceKernel().pack(layer, q)
    torch.testing.assert_close(Fp8ReferenceKernel().apply(layer, x, bias), ref,
                               atol=1e-4, rtol=1e-4)
    # w8a8 (torch's CPU build has _scaled_mm too): activations rounded to e4m3 per token.
    for dtype, tol in ((torch.float32, 0.06), (torch.bfloat16, 0.08)):
        y = Fp8ScaledMMKernel().apply(layer, x.to(dtype), bias.to(dtype))
        assert y.dtype == dtype
        assert (y.float() - ref).norm() / ref.norm() < tol


def test_cuda_platform_offers_scaled_mm_from_sm89():
    from runtime.platforms.cuda.platform import CudaPlatform, GpuDevice

    def gpu(capability):
        return CudaPlatform([GpuDevice(0, "fake", capability, 1 << 34)])

    assert isinstance(gpu((9, 0)).quantization_kernel("fp8", {}), Fp8ScaledMMKernel)
    # Ampere: no fp8 matmuls, the weight-only reference runs
    assert gpu((8, 0)).quantization_kernel("fp8", {}) is None
    assert gpu((9, 0)).quantization_kernel("int4", {}) is None


def _run(path, quantization=None):
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
              quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    return llm, llm.generate(PROMPTS, params)


def _assert_same_model(out, ref) -> float:
    worst = 0.0
    for i, (a, b) in enumerate(zip(out, ref)):
        sa, sb = a.outputs[0], b.outputs[0]
        assert sa.token_ids == sb.token_ids, f"prompt {i}: greedy tokens differ"
        pairs = [(next(iter(p.values())).logprob, next(iter(q.values())).logprob)
                 for p, q in zip(sa.logprobs, sb.logprobs)]
        pairs += [(next(iter(p.values())).logprob, next(iter(q.values())).logprob)
                  for p, q in zip(a.prompt_logprobs, b.prompt_logprobs) if p is not None]
        worst = max(worst, max(abs(x - y) for x, y in pairs))
    assert worst < LOGPROB_ATOL, f"logprobs differ by {worst:.2e}"
    return worst


def _linear_layers(llm):
    model = llm.engine.core.executor.worker.runner.model
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]


def _weight_bytes(m) -> int:
    return sum(p.numel() * p.element_size() for n, p in m.named_parameters(recurse=False)
               if n != "bias")


def _fp8_bytes(n, k, static):  # e4m3 weight, fp32 scale per row, one fp32 input scale
    return n * k + 4 * n + (4 if static else 0)


def _int4_bytes(n, k, g, act_order=False):  # two codes a byte, fp32 scale and zero per group
    # act-order permutes the input (int32 indices) when the layer has more than one group
    return n * k // 2 + 2 * 4 * n * (k // g) + (4 * k if act_order and k > g else 0)


def _fp4_bytes(n, k, block, global_scale):  # two codes a byte, one byte per block scale
    return n * k // 2 + n * k // block + (4 * n if global_scale else 0)


def _ct(weights: dict, fmt: str, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status":
            "compressed", "ignore": ["lm_head"], **extra,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


CASES = {
    "fp8-static-per-tensor": (
        lambda w: formats.fp8(w, False, (), True),
        {"quant_method": "fp8", "activation_scheme": "static"}, None,
        lambda n, k: _fp8_bytes(n, k, True)),
    "compressed-tensors-fp8-per-channel": (
        lambda w: formats.fp8(w, True, (w.shape[0], 1), False),
        _ct({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
             "dynamic": False}, "float-quantized"), "fp8",
        lambda n, k: _fp8_bytes(n, k, False)),
    "gptq-sym-group32": (
        lambda w: formats.gptq(w, GROUP, True, False),
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
         "sym": True}, None, lambda n, k: _int4_bytes(n, k, GROUP)),
    "gptq-asym-act-order-group32": (
        lambda w: formats.gptq(w, GROUP, False, True),
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False},
        "gptq", lambda n, k: _int4_bytes(n, k, GROUP, act_order=True)),
    "awq-group32": (
        lambda w: formats.awq(w, GROUP),
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"}, None, lambda n, k: _int4_bytes(n, k, GROUP)),
    "compressed-tensors-mxfp4": (
        lambda w: formats.mxfp4(w),
        _ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
             "symmetric": True}, "mxfp4-pack-quantized"), None,
        lambda n, k: _fp4_bytes(n, k, 32, False)),
    "compressed-tensors-nvfp4": (
        lambda w: formats.nvfp4(w),
        _ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
             "symmetric": True}, "nvfp4-pack-quantized"), "nvfp4",
        lambda n, k: _fp4_bytes(n, k, 16, True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_dequantized_model(case, tiny_model_factory, tmp_path, monkeypatch):
    from runtime.quantization.cpu import KERNEL_ENV
    monkeypatch.setenv(KERNEL_ENV, "native" if case == "gptq-sym-group32" else "reference")
    quantize, qconfig, flag, layer_bytes = CASES[case]
    src = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    quant, dense = str(tmp_path / "quantized"), str(tmp_path / "dense")
    formats.write_checkpoints(src, quant, dense, quantize, qconfig)
    ref_llm, ref = _run(dense)
    llm, out = _run(quant, flag)
    _assert_same_model(out, ref)
    for name, m in _linear_layers(llm):
        assert _weight_bytes(m) == layer_bytes(m.output_size, m.input_size), name
    worker, ref_worker = (x.engine.core.executor.worker for x in (llm, ref_llm))
    dense_linear = sum(4 * m.output_size * m.input_size for _, m in _linear_layers(ref_llm))
    quant_linear = sum(_weight_bytes(m) for _, m in _linear_layers(llm))
    assert ref_worker.model_bytes - worker.model_bytes == dense_linear - quant_linear


def test_fp8_at_load_matches_dequantized_model(tiny_model_factory, tmp_path):
    src = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    dense = shutil.copytree(src, str(tmp_path / "dense"))
    tensors = load_file(os.path.join(dense, "model.safetensors"))
    for key, t in tensors.items():
        if any(f".{p}." in key for p in formats.LINEAR_NAMES):
            tensors[key] = quantize_fp8(t).dequantize()
    save_file(tensors, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    _, ref = _run(dense)
    llm, out = _run(src, "fp8")
    _assert_same_model(out, ref)
    for name, m in _linear_layers(llm):
        assert m.weight.dtype == torch.float8_e4m3fn, name
        assert _weight_bytes(m) == _fp8_bytes(m.output_size, m.input_size, False), name


def test_ignored_layers_stay_dense(tiny_model_factory, tmp_path):
    """compressed-tensors' ignore list: the MLP down projections are left in float."""
    src = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    quant, dense = str(tmp_path / "quantized"), str(tmp_path / "dense")
    config = _ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
                 "mxfp4-pack-quantized", ignore=["lm_head", "re:.*down_proj$"])
    formats.write_checkpoints(src, quant, dense, formats.mxfp4, config)
    tensors = load_file(os.path.join(quant, "model.safetensors"))
    dense_tensors = load_file(os.path.join(dense, "model.safetensors"))
    for key in [k for k in tensors if ".down_proj." in k]:
        del tensors[key]
    for key in [k for k in dense_tensors if ".down_proj." in k]:
        tensors[key] = dense_tensors[key]
    save_file(tensors, os.path.join(quant, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(quant, dtype="float32", kv_cache_memory="16MiB")
    for name, m in _linear_layers(llm):
        assert (m.method.name == "unquantized") == name.endswith("down_proj"), name


def _with_config(tiny_model_factory, tmp_path, qconfig: dict) -> str:
    path = shutil.copytree(tiny_model_factory("LlamaForCausalLM"), str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("qconfig,flag,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, "3 bits.*supported: 4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None,
     "'gemv'.*supported: 'gemm'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "block-wise fp8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq",
     "--quantization awq asked for.*gptq"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"}, "int-quantized"), None,
     "type: int.*supported: fp8"),
    (_ct({"num_bits": 4, "type": "float", "group_size": 16}, "nvfp4-pack-quantized"), "fp8",
     "compressed-tensors \\(nvfp4\\).*--quantization nvfp4"),
    ({"quant_method": "bitsandbytes"}, None, "'bitsandbytes' is not supported; known:"),
])
def test_bad_checkpoint_configs(qconfig, flag, message, tiny_model_factory, tmp_path):
    path = _with_config(tiny_model_factory, tmp_path, qconfig)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization=flag)


def test_group_size_must_divide_the_input(tiny_model_factory, tmp_path):
    src = tiny_model_factory("LlamaForCausalLM", intermediate_size=256)
    quant, dense = str(tmp_path / "quantized"), str(tmp_path / "dense")
    gptq = partial(formats.gptq, group=GROUP, sym=True, desc_act=False)
    formats.write_checkpoints(src, quant, dense, gptq, {
        "quant_method": "gptq", "bits": 4, "group_size": 48, "desc_act": False, "sym": True})
    with pytest.raises(ValueError, match="group size 48 does not divide the input size 64"):
        LLM(quant, dtype="float32", kv_cache_memory="16MiB")


def test_methods_only_from_checkpoints_say_so():
    for name in ("gptq", "awq", "mxfp4", "nvfp4"):
        with pytest.raises(ValueError, match="checkpoint"):
            build_quant_config(name, object())


def test_runtime_plugins_lists_every_method(capsys):
    from runtime.cli.plugins_cmd import plugins_command
    assert plugins_command(argparse.Namespace(device="cpu", json=False)) == 0
    out = capsys.readouterr().out
    for row in ("fp8 ", "gptq ", "awq ", "mxfp4 ", "nvfp4 "):
        assert row in out
    assert "cuda (sm89+)" in out and "fp4_reference (reference)" in out
    hook = get_plugin_manager().hook
    from runtime.platforms.cpu.platform import CpuPlatform
    assert hook.runtime_quantization_kernel(platform=CpuPlatform(), method="fp8", params={}) is None


TP_CASES = {  # name: (writer, quantization_config)
    "fp8": (lambda w: formats.fp8(w, False, (), False), {"quant_method": "fp8"}),
    "gptq": (lambda w: formats.gptq(w, 16, False, False),
             {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": False}),
    "awq": (lambda w: formats.awq(w, 16), {"quant_method": "awq", "bits": 4, "group_size": 16}),
    "nvfp4": (formats.nvfp4, CASES["compressed-tensors-nvfp4"][1]),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_ranks_take_their_slices(case):
    """Each of two ranks loads the full checkpoint tensors; their outputs put together (columns
    concatenated per q/k/v, row-parallel partial sums added) equal the dequantized layers."""
    from runtime.quantization.registry import from_checkpoint
    from runtime.layers.build_context import BuildContext
    from runtime.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear)
    write, qconfig = TP_CASES[case]
    config = from_checkpoint(qconfig)
    config.kernel = config.reference_kernel()
    rng = np.random.default_rng(0)
    shards = {"q": 64, "k": 32, "v": 32}  # 4 heads and 2 KV heads of 16, hidden 64
    parts = {s: write(rng.standard_normal((n, 64)).astype(np.float32)) for s, n in shards.items()}
    gate_up = [write(rng.standard_normal((96, 64)).astype(np.float32)) for _ in range(2)]
    down = write(rng.standard_normal((64, 192)).astype(np.float32))
    x, h = torch.randn(3, 64), torch.randn(3, 192)
    outs = {"qkv": [], "gate_up": [], "down": []}
    for rank in range(2):
        ctx = BuildContext(dtype=torch.float32, device=torch.device("cpu"),
                           attention_backend=object, quant_config=config, tp_rank=rank, tp_size=2)
        layers = {"qkv": QKVParallelLinear(64, 16, 4, 2, False, ctx, "model.layers.0.qkv_proj"),
                  "gate_up": MergedColumnParallelLinear(64, [96, 96], False, ctx, "gate_up_proj"),
                  "down": RowParallelLinear(192, 64, False, ctx, "down_proj")}
        for name, tensors_by_shard in (("qkv", {s: p[0] for s, p in parts.items()}),
                                       ("gate_up", {i: p[0] for i, p in enumerate(gate_up)}),
                                       ("down", {None: down[0]})):
            layer = layers[name]
            for shard, tensors in tensors_by_shard.items():
                for tname, t in tensors.items():
                    p = getattr(layer, tname)
                    args = (p, torch.as_tensor(t)) + (() if shard is None else (shard,))
                    p.weight_loader(*args)
            layer.method.process_weights_after_loading(layer)
        outs["qkv"].append(layers["qkv"](x).split([32, 16, 16], -1))
        outs["gate_up"].append(layers["gate_up"](x).split([48, 48], -1))
        down_layer = layers["down"]  # its partial sum, before the all-reduce
        outs["down"].append(down_layer.method.apply(down_layer, h[:, 96 * rank:96 * (rank + 1)]))

    def dense(p):
        return torch.as_tensor(np.asarray(p[1], np.float32))

    qkv = torch.cat([torch.cat([o[i] for o in outs["qkv"]], -1) for i in range(3)], -1)
    torch.testing.assert_close(qkv, x @ torch.cat([dense(parts[s]) for s in "qkv"]).T,
                               atol=1e-4, rtol=1e-4)
    gu = torch.cat([torch.cat([o[i] for o in outs["gate_up"]], -1) for i in range(2)], -1)
    torch.testing.assert_close(gu, x @ torch.cat([dense(p) for p in gate_up]).T,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sum(outs["down"]), h @ dense(down).T, atol=1e-4, rtol=1e-4)
