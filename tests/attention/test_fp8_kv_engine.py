"""`kv_cache_dtype="fp8"` end to end on a tiny random Llama.

The reference is transformers with its attention reading K and V through the same FP8 round trip
(`x / scale` saturated, rounded to e4m3/e5m2, times `scale`): greedy tokens must be equal and
logprobs close. Against the unquantized run only a loose bound holds: a random model this small
turns the cache's rounding (3 mantissa bits for e4m3) into visible logit changes, so greedy
tokens part early (measured below).
"""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from parity import PROMPTS, hf_greedy
from runtime import LLM, SamplingParams
from runtime.attention_backends.base import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from runtime.attention_backends.torch_paged import quantize_kv
from runtime.cli.engine_args import add_engine_args, engine_kwargs
from runtime.layers.attention import Attention

MAX_TOKENS = 12
# Against the reference with the same rounding: our K and V differ from transformers' in the last
# float32 bits, so now and then one element sits on an FP8 rounding boundary and rounds the other
# way (one e4m3 step is 6%); measured up to 3e-3.
LOGPROB_ATOL = 1e-2
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
# Teacher-forced (prompt) logprobs of 8 random 40-token prompts, FP8 cache vs the float32 one:
# measured mean |difference| 0.13 and max 1.13 for e4m3, 0.24 and 1.16 for e5m2.
PROMPT_LOGPROB_BOUND = {"fp8": (0.2, 2.0), "fp8_e5m2": (0.4, 2.5)}


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM")


def fp8_reference(model_path: str, kv_cache_dtype: str, scales: list[tuple[float, float]]):
    """The transformers model whose attention sees K and V after the FP8 cache's round trip,
    with layer i's (k_scale, v_scale) = scales[i]."""
    dtype = FP8_KV_CACHE_DTYPES[kv_cache_dtype]

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = (torch.tensor(s) for s in scales[module.layer_idx])
        key = quantize_kv(key, k_scale, dtype).float() * k_scale
        value = quantize_kv(value, v_scale, dtype).float() * v_scale
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"fp8_kv_{kv_cache_dtype}"
    AttentionInterface.register(name, attention)
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_path, torch_dtype=torch.float32, attn_implementation=name).eval()


def assert_matches(outputs, reference) -> None:
    for i, (out, prompt) in enumerate(zip(outputs, PROMPTS)):
        tokens, logprobs = hf_greedy(reference, prompt, MAX_TOKENS)
        sample = out.outputs[0]
        assert sample.token_ids == tokens, f"prompt {i}: greedy tokens differ from the reference"
        ours = [next(iter(pos.values())).logprob for pos in sample.logprobs]
        worst = max(abs(a - b) for a, b in zip(ours, logprobs))
        assert worst < LOGPROB_ATOL, f"prompt {i}: logprob differs by {worst:.2e}"


def engine_scales(llm: LLM) -> list[tuple[float, float]]:
    layers = [m for m in llm.engine.core.executor.worker.runner.model.modules()
              if isinstance(m, Attention)]
    return [(layer.impl.k_scale.item(), layer.impl.v_scale.item()) for layer in layers]


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_greedy_matches_transformers_with_the_same_rounding(model_path, kv_cache_dtype):
    llm = LLM(model_path, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype=kv_cache_dtype)
    outputs = generate(llm)
    reference = fp8_reference(model_path, kv_cache_dtype, engine_scales(llm))
    assert_matches(outputs, reference)


def test_blocks_and_agreement_against_the_unquantized_cache(model_path):
    prompts = [torch.randint(100, 49000, (40,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for kv in KV_CACHE_DTYPES[:2] + KV_CACHE_DTYPES[3:]:  # auto, fp8, fp8_e5m2
        llm = LLM(model_path, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype=kv)
        runs[kv] = (llm.engine.core.num_blocks, generate(llm, prompts, params))
    blocks, base = runs.pop("auto")
    means = {}
    for kv, (fp8_blocks, outputs) in runs.items():
        assert fp8_blocks == 4 * blocks  # float32 -> one byte per element, same budget
        diffs = torch.tensor([abs(a[t].logprob - b[t].logprob)
                              for x, y in zip(base, outputs)
                              for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])
                              for t in a])
        mean_bound, max_bound = PROMPT_LOGPROB_BOUND[kv]
        assert 0 < diffs.mean() < mean_bound and diffs.max() < max_bound, (kv, diffs.mean(),
                                                                            diffs.max())
        means[kv] = diffs.mean()
    assert means["fp8"] < means["fp8_e5m2"]  # three mantissa bits round closer than two


def test_bfloat16_model_gets_twice_the_blocks(model_path):
    blocks = [LLM(model_path, dtype="bfloat16", kv_cache_memory="16MiB",
                  kv_cache_dtype=kv).engine.core.num_blocks for kv in ("auto", "fp8")]
    assert blocks[1] == 2 * blocks[0]


def test_calculated_scales_come_from_the_first_batch(model_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    outputs = generate(llm)
    scales = engine_scales(llm)
    assert all(k != 1.0 and v != 1.0 for k, v in scales)
    generate(llm)  # computed once: later batches keep them
    assert engine_scales(llm) == scales
    reference = fp8_reference(model_path, "fp8", scales)
    assert_matches(outputs, reference)


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("kv_scale",)])
def test_checkpoint_scales_are_loaded(model_path, tmp_path, names):
    folder = tmp_path / "scaled"
    folder.mkdir()
    for name in os.listdir(model_path):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(model_path, name), folder / name)
    weights = load_file(os.path.join(model_path, "model.safetensors"))
    num_layers = json.load(open(os.path.join(model_path, "config.json")))["num_hidden_layers"]
    want = []
    for i in range(num_layers):
        values = {n: torch.tensor(0.01 * (i + 1) * (j + 1)) for j, n in enumerate(names)}
        weights.update({f"model.layers.{i}.self_attn.{n}": v for n, v in values.items()})
        k, v = (values.get("k_scale", values.get("kv_scale")),
                values.get("v_scale", values.get("kv_scale")))
        want.append((k.item(), v.item()))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    assert engine_scales(llm) == [pytest.approx(pair) for pair in want]
    outputs = generate(llm)
    reference = fp8_reference(model_path, "fp8", want)
    assert_matches(outputs, reference)


def test_a_bad_kv_cache_dtype_lists_the_allowed_values(model_path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, "
                                         "fp8_e5m2, got 'int8'"):
        LLM(model_path, kv_cache_dtype="int8")


def test_the_flags_reach_the_engine_config(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2",
                                              "--calculate-kv-scales"]))
    assert kwargs["kv_cache_dtype"] == "fp8_e5m2" and kwargs["calculate_kv_scales"] is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    err = capsys.readouterr().err
    assert "invalid choice: 'int8'" in err and all(name in err for name in KV_CACHE_DTYPES)
