"""GGUF files of the architectures beyond llama/qwen, written here as llama.cpp's converter
writes them, run with the same greedy tokens and logprobs as transformers on the same weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.model_loader.test_gguf_loader import add_decoder_shape, add_tiny_tokenizer, finish
from tests.parity import assert_matches_hf, hf_greedy

VOCAB = 128
PROMPTS = [[VOCAB - 1, 5, 9, 12, 40], [VOCAB - 1] + list(range(20, 60))]
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Phi-3 keeps its fused projections: qkv_proj is attn_qkv, gate_up_proj is ffn_up.
PHI3_LAYER = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_phi3_gguf(path: str, model: torch.nn.Module) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, "phi3")
    add_decoder_shape(writer, config)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    add_tiny_tokenizer(writer, VOCAB)
    writer.add_pad_token_id(0)
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        gguf_module = TOP.get(module) or \
            f"blk.{module.split('.')[2]}.{PHI3_LAYER[module.split('.', 3)[3]]}"
        writer.add_tensor(f"{gguf_module}.{suffix}", tensor.numpy().astype(np.float32))
    finish(writer)


def test_phi3_gguf_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    path = str(tmp_path / "tiny-phi3.gguf")
    write_phi3_gguf(path, model)
    references = [hf_greedy(model, p, 8) for p in PROMPTS]
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.model_config.architecture == "Phi3ForCausalLM"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)


def write_gemma_gguf(path: str, arch: str, model: torch.nn.Module) -> None:
    """As llama.cpp's converter: gguf's tensor names, norm weights stored as 1 + w, no
    separate LM head (Gemma ties it)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    add_decoder_shape(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    add_tiny_tokenizer(writer, VOCAB)
    writer.add_pad_token_id(0)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        module, suffix = name.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        writer.add_tensor(f"{names.get_name(module)}.{suffix}",
                          data + 1 if name.endswith("norm.weight") else data)
    finish(writer)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers_reading_the_same_file(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    cls = transformers.Gemma2ForCausalLM if arch == "gemma2" else transformers.Gemma3ForCausalLM
    config = cls.config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=8, initializer_range=0.2, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gemma_gguf(str(path), arch, cls(config).eval())
    # the reference is transformers' own reading of the file (its config defaults included)
    hf = cls.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, 8) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.model_config.architecture == cls.__name__
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)
