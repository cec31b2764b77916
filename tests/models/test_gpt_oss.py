"""Native gpt-oss against transformers on the same random weights: attention sinks on sliding
(window 8) and full layers, YaRN rope, the biased router and clamped SwiGLU experts; greedy tokens
and logprobs with chunked prefill, prefix caching and preemption in play, on the CPU kernel
backend and the portable one; two tensor-parallel ranks; and the same weights as an MXFP4
checkpoint, which transformers and the engine both decode."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.models.registry import choose_model
from runtime.quantization.fp4 import E2M1
from runtime.testing.tiny_model import VOCAB_SIZE, save_tokenizer
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 40  # one long prompt fits (98 tokens), the whole batch does not: preemption
# The shared prompts' lengths in the tiny vocabulary; the last prompt repeats the second one's
# 37 tokens: its first blocks come from the prefix cache.
GPT_OSS_PROMPTS = [[3 + t % (VOCAB_SIZE - 3) for t in p] for p in PROMPTS]
GPT_OSS_PROMPTS.append(GPT_OSS_PROMPTS[1] + [5, 6, 7])
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
    # gpt-oss's own rope settings, scaled to the tiny context: YaRN with an untruncated ramp
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(folder, the transformers model saved there). transformers starts the biases at zero;
    here they and the sinks are drawn too (sinks of about the size of the scores), so each of
    them changes the tokens when dropped."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**CONFIG)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    model.save_pretrained(path)
    save_tokenizer(path)
    hf = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    return path, hf


@pytest.fixture(scope="module")
def references(gpt_oss):
    return [hf_greedy(gpt_oss[1], p, MAX_NEW) for p in GPT_OSS_PROMPTS]


def _kv_bytes() -> int:
    return NUM_BLOCKS * 2 * CONFIG["num_hidden_layers"] * BLOCK_SIZE * 2 * 16 * 4


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_paged"])
def test_gpt_oss_matches_transformers(backend, gpt_oss, references):
    path, _ = gpt_oss
    assert choose_model(["GptOssForCausalLM"]).impl == "native"
    llm = LLM(path, dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=_kv_bytes(),
              max_num_batched_tokens=32, max_model_len=128, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(GPT_OSS_PROMPTS, params), references)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert core.kv.num_cache_hits > 0, "the shared prefix was meant to hit"
    layers = core.executor.worker.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [8, None]
    assert all(layer.self_attn.attn.impl.sinks is layer.self_attn.attn.sinks
               for layer in layers)


def test_gpt_oss_tensor_parallel_matches_one_rank(gpt_oss, references):
    """Two ranks: heads and their sinks split, every expert's intermediate dimension split, the
    down bias added once."""
    llm = LLM(gpt_oss[0], dtype="float32", kv_cache_memory="8MiB", num_threads=1,
              tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    try:
        outputs = llm.generate(GPT_OSS_PROMPTS[:3], params)
    finally:
        llm.engine.core.shutdown()
    assert_matches_hf(outputs, references[:3])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> transformers' MXFP4 (`_blocks` [..., out, in / 32, 16] uint8, two
    e2m1 codes per byte low nibble first; `_scales` [..., out, in / 32] uint8 e8m0): each block's
    largest value at most 6 times its power-of-two scale, each value its nearest e2m1."""
    *lead, out, width = w.shape
    blocks = w.reshape(*lead, out, width // 32, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0))
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1[:8]).abs().argmin(-1) | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exponent + 127).to(
        torch.uint8)


def test_gpt_oss_mxfp4_matches_transformers(gpt_oss, tmp_path):
    """The same weights as an MXFP4 checkpoint in transformers' format (the experts as
    `_blocks`/`_scales`): transformers decodes it (Mxfp4Config(dequantize=True)), and so do
    we, to the same tokens and logprobs."""
    path = tmp_path / "mxfp4"
    shutil.copytree(gpt_oss[0], path)
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(weights.pop(name).transpose(1, 2))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    hf = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    prompts = GPT_OSS_PROMPTS[:3]
    references = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(prompts, params), references)
