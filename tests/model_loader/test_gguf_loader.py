"""The GGUF reader against transformers (SmolLM2) and against GGUF files written here.

Everything derived from a GGUF file is cached; here in one temporary folder (conftest.py).
"""
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from runtime.default_model import default_model_path
from runtime.layers.rotary import rope_parameters
from runtime.model_loader.gguf_loader import iterate_gguf_weights, load_gguf_config, load_gguf_tokenizer


# ---------------------------------------------------------------- SmolLM2, against transformers


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_config(smollm2_path):
    return load_gguf_config(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf_state_dict(smollm2_path, smollm2_config) -> dict[str, torch.Tensor]:
    directory, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=smollm2_config, dtype=torch.float32)
    return model.state_dict()


def test_smollm2_config(smollm2_config) -> None:
    c = smollm2_config
    assert c.model_type == "llama" and c.tie_word_embeddings
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert c.max_position_embeddings == 8192 and c.vocab_size == 49152
    assert rope_parameters(c) == {"rope_type": "default", "rope_theta": 100000.0, "max_position_embeddings": 8192}


def test_smollm2_weights_equal_transformers(smollm2_path, smollm2_config, smollm2_hf_state_dict) -> None:
    ours = dict(iterate_gguf_weights(smollm2_path, smollm2_config, torch.float32))
    hf = smollm2_hf_state_dict
    assert "lm_head.weight" not in ours  # tied: no output.weight in the file
    assert set(ours) == set(hf) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == hf[name].shape, name
        assert torch.equal(tensor, hf[name]), name


def test_smollm2_tokenizer(smollm2_path) -> None:
    tokenizer = load_gguf_tokenizer(smollm2_path)
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer("Hello world").input_ids) == "Hello world"


# ---------------------------------------------------------------- tiny GGUF files written here

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=96, rms_norm_eps=1e-6, initializer_range=0.2,
)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
Q8_0, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


def gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama_cpp_rope_freqs(config: LlamaConfig) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for "llama3" rope."""
    rope, dim = config.rope_parameters, config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of `vocab_size` tokens (ASCII, one merge, one special), and a chat template."""
    tokens = ["Ġ", "Ġt", "<|end|>"]
    tokens = [chr(c) for c in range(33, 33 + vocab_size - len(tokens))] + tokens
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab_size - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(vocab_size - 1)
    writer.add_eos_token_id(vocab_size - 1)
    writer.add_chat_template("{% for m in messages %}<|end|>{{ m['role'] }}: {{ m['content'] }}{% endfor %}")


def add_decoder_shape(writer: gguf.GGUFWriter, config) -> None:
    """The header fields every decoder architecture of llama.cpp carries."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(path: str, arch: str, config, rope_scaling: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a random transformers model as llama.cpp would; return the weights a reader must recover."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = gguf.GGUFWriter(path, arch)
    add_decoder_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["rope_type"]))
        writer.add_rope_scaling_factor(rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"])
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config))
    add_tiny_tokenizer(writer, config.vocab_size)

    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        qtype = F32 if data.ndim == 1 else Q8_0 if ("q_proj" in name or "embed" in name or "up_proj" in name) else F16
        if qtype == Q8_0:
            expected[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, Q8_0), Q8_0))
        elif qtype == F16:
            expected[name] = tensor.half().float()
        else:
            expected[name] = tensor.clone()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
        if qtype == Q8_0:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(gguf_name(name), data.astype(np.float16 if qtype == F16 else np.float32))
    finish(writer)
    return expected


CASES = {
    # permuted q/k weights and biases, untied lm_head, llama3 rope kept in rope_freqs
    "llama": lambda: LlamaConfig(
        **TINY, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=16384,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    # q/k/v biases, tied embeddings
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True, max_position_embeddings=512,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # q_norm / k_norm
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_round_trip(tmp_path, arch: str) -> None:
    config = CASES[arch]()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = write_tiny_gguf(path, arch, config)

    loaded = load_gguf_config(path)
    assert loaded.model_type == config.model_type
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(loaded, key) == getattr(config, key), key
    assert rope_parameters(loaded) == pytest.approx(rope_parameters(config))

    ours = dict(iterate_gguf_weights(path, loaded, torch.float32))
    assert set(ours) == set(expected)
    assert ("lm_head.weight" in ours) == (not config.tie_word_embeddings)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name

    bf16 = dict(iterate_gguf_weights(path, loaded, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16["model.layers.0.self_attn.k_proj.weight"], expected["model.layers.0.self_attn.k_proj.weight"].bfloat16())


def test_yarn_metadata_becomes_rope_parameters(tmp_path) -> None:
    config = CASES["qwen2"]()
    path = str(tmp_path / "tiny-yarn.gguf")
    write_tiny_gguf(path, "qwen2", config, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    params = rope_parameters(load_gguf_config(path))
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 128
