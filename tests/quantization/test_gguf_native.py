"""GGUF-native weights: the torch block dequantization against gguf's own for every type, fused
layers with mixed types, and SmolLM2 run from its quantized weights against dequantize-at-load."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from runtime.quantization.gguf import (
    GGML_TYPES,
    GGUFConfig,
    GGUFWeight,
    dequantize,
    dequantize_blocks,
)
from runtime import LLM, SamplingParams
from runtime.default_model import default_model_path
from runtime.layers.build_context import BuildContext
from runtime.layers.linear import LinearBase, QKVParallelLinear

QUANTIZED = [t for t, (_, block, _) in GGML_TYPES.items() if block > 1]
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py has no quantizer for these


def _blocks(qtype: int, rows: int, cols: int, rng) -> np.ndarray:
    """`rows` rows of `qtype` data: gguf's quantizer where it has one, else random bytes with
    sane float16 super-block scales (every bit of the packed fields is exercised)."""
    name, block, size = GGML_TYPES[qtype]
    if name not in K_TYPES:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale = np.array([0.0123], dtype=np.float16).view(np.uint8)
    if name == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2] = scale
        raw[:, 2:4] = np.array([0.0071], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: GGML_TYPES[t][0])
def test_dequantize_matches_gguf(qtype):
    raw = _blocks(qtype, 6, 512, np.random.default_rng(qtype))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    ours = dequantize(qtype, torch.from_numpy(raw), (6, 512))
    np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(default_model_path())


def test_smollm2_tensors_match_gguf(smollm2_reader):
    """The file's own Q4_1 and Q8_0 tensors (first rows), dequantized both ways."""
    reader = smollm2_reader
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0") and t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            raw = np.array(t.data[:64])
            ref = gguf.quants.dequantize(raw, t.tensor_type)
            ours = dequantize_blocks(int(t.tensor_type),
                                     torch.from_numpy(raw).reshape(-1, GGML_TYPES[int(t.tensor_type)][2]))
            np.testing.assert_array_equal(ours.reshape(ref.shape).numpy(), ref)
    assert seen == {"Q4_1", "Q8_0"}


def test_fused_layer_with_mixed_types():
    """QKV parts of different types: one segment per run of a type, output as the dense layer."""
    rng = np.random.default_rng(0)
    config = GGUFConfig()
    config.kernel = config.reference_kernel()
    ctx = BuildContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=object,
                       quant_config=config)
    layer = QKVParallelLinear(256, 32, 4, 2, bias=False, ctx=ctx)
    types = {"q": 8, "k": 2, "v": 2}  # Q8_0, then two Q4_0 parts that fuse
    dense = []
    for shard, rows in (("q", 128), ("k", 64), ("v", 64)):
        raw = torch.from_numpy(_blocks(types[shard], rows, 256, rng))
        layer.weight.weight_loader(layer.weight, GGUFWeight(types[shard], raw, (rows, 256)), shard)
        dense.append(dequantize(types[shard], raw, (rows, 256)))
    layer.method.process_weights_after_loading(layer)
    assert [s[0] for s in layer.method.segments] == [8, 2]
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ torch.cat(dense).T, atol=1e-4, rtol=1e-4)


def test_smollm2_native_matches_dequantized(smollm2_reader):
    # Every forward pass dequantizes all 210 linear weights, so the run is kept short.
    prompts = [[1, 504, 3458, 282], [1, 9690, 28, 2683]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0)
    runs = {}
    for q in (None, "gguf"):
        llm = LLM(dtype="float32", kv_cache_memory="4MiB", max_model_len=32, max_num_seqs=2,
                  max_num_batched_tokens=8, quantization=q)
        runs[q] = (llm, llm.generate(prompts, params))
    for a, b in zip(runs["gguf"][1], runs[None][1]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(p.values())).logprob for p in a.outputs[0].logprobs]
        lb = [next(iter(p.values())).logprob for p in b.outputs[0].logprobs]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 2e-3

    # Resident bytes of the linear layers: exactly the file's quantized blocks.
    reader = smollm2_reader
    linear = (".attn_q.", ".attn_k.", ".attn_v.", ".attn_output.", ".ffn_gate.", ".ffn_up.",
              ".ffn_down.")
    expected = sum(int(t.n_bytes) for t in reader.tensors if any(s in t.name for s in linear))
    model = runs["gguf"][0].engine.core.executor.worker.runner.model
    measured = sum(p.numel() * p.element_size() for m in model.modules()
                   if isinstance(m, LinearBase) for p in m.parameters(recurse=False))
    assert measured == expected
    dense = runs[None][0].engine.core.executor.worker.runner.model
    dense_bytes = sum(4 * m.output_size * m.input_size for m in dense.modules()
                      if isinstance(m, LinearBase))
    assert measured * 6 < dense_bytes  # Q4_1: 5 bits a weight against 32
    assert math.isclose(measured / dense_bytes, 20 / 32 / 4)
