"""GGUF files of the MoE architectures (qwen2moe, qwen3moe), written here as llama.cpp's converter
writes them (experts stacked per projection; Q8_0, F16 and F32 tensors), run with the same greedy
tokens and logprobs as transformers on the same weights."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.model_loader.gguf_loader import iterate_gguf_weights, load_gguf_config
from tests.model_loader.test_gguf_loader import add_decoder_shape, add_tiny_tokenizer, finish
from tests.parity import assert_matches_hf, hf_greedy

VOCAB = 128
PROMPTS = [[VOCAB - 1, 5, 9, 12, 40], [VOCAB - 1] + list(range(20, 60))]
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

CASES = {
    # a sigmoid-gated shared expert; llama.cpp never renormalises the top-k weights
    "qwen2moe": (transformers.Qwen2MoeForCausalLM, dict(
        MOE, shared_expert_intermediate_size=48, norm_topk_prob=False)),
    # q/k norms; llama.cpp always renormalises
    "qwen3moe": (transformers.Qwen3MoeForCausalLM, dict(MOE, head_dim=16, norm_topk_prob=True)),
}


def _q8_0(data: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """The Q8_0 blocks of `data`, and the weights they dequantize to."""
    blocks = gguf.quants.quantize(data, Q8_0)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0))


def write_moe_gguf(path: str, arch: str, model: torch.nn.Module) -> None:
    """As convert_hf_to_gguf.py's Qwen2MoeModel: gguf's tensor names, each projection's experts
    stacked into one [experts, out, in] tensor (Q8_0 here), other matrices F16 but the router's
    (F32), the shared-expert gate squeezed to [hidden] (as older converters wrote it). The
    model's weights are replaced by what the file holds, so it is the reference for the file."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    add_decoder_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    add_tiny_tokenizer(writer, VOCAB)
    writer.add_pad_token_id(0)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    size = config.moe_intermediate_size
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        data = tensor.numpy()
        if suffix == "gate_up_proj":  # transformers stacks gate and up: [E, 2I, H]
            gate, gate_ref = _q8_0(data[:, :size])
            up, up_ref = _q8_0(data[:, size:])
            writer.add_tensor(f"{names.get_name(f'{module}.gate_proj')}.weight", gate, raw_dtype=Q8_0)
            writer.add_tensor(f"{names.get_name(f'{module}.up_proj')}.weight", up, raw_dtype=Q8_0)
            tensor.copy_(torch.cat([gate_ref, up_ref], dim=1))
        elif suffix == "down_proj":
            down, down_ref = _q8_0(data)
            writer.add_tensor(f"{names.get_name(f'{module}.down_proj')}.weight", down, raw_dtype=Q8_0)
            tensor.copy_(down_ref)
        elif module.endswith("shared_expert_gate"):
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", data.squeeze(0))
        elif data.ndim == 2 and not module.endswith(".mlp.gate"):  # the router stays F32
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", data.astype(np.float16))
            tensor.copy_(tensor.half().float())
        else:
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", data)
    finish(writer)


def assert_weights_equal(weights, model: torch.nn.Module) -> None:
    """The reader's tensors, one per expert, equal the model's (stacked) weights in its shapes."""
    state, size, seen = model.state_dict(), model.config.moe_intermediate_size, set()
    for name, tensor in weights:
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if expert is None:
            expected, seen = state[name], seen | {name}
        else:
            block, j, part = expert.group(1), int(expert.group(2)), expert.group(3)
            stacked = state[f"{block}.{'down_proj' if part == 'down' else 'gate_up_proj'}"][j]
            expected = {"gate": stacked[:size], "up": stacked[size:], "down": stacked}[part]
            seen |= {f"{block}.down_proj" if part == "down" else f"{block}.gate_up_proj"}
        assert tensor.shape == expected.shape and torch.equal(tensor, expected), name
    assert seen == set(state)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_moe_gguf_matches_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    cls, overrides = CASES[arch]
    config = cls.config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    model = cls(config).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    with torch.no_grad():
        write_moe_gguf(path, arch, model)
    read = load_gguf_config(path)
    for key in ("num_experts", "num_experts_per_tok", "norm_topk_prob", *overrides):
        assert getattr(read, key) == getattr(config, key), key
    assert_weights_equal(iterate_gguf_weights(path, read, torch.float32), model)
    references = [hf_greedy(model, p, 8) for p in PROMPTS]
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.model_config.architecture == cls.__name__
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)
