"""RotaryEmbedding against transformers' rope functions and apply_rotary_pos_emb."""
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, StableLmConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from runtime.layers.rotary import RotaryEmbedding, get_rope, rope_parameters

HEAD_DIM = 64
NUM_HEADS, NUM_KV_HEADS = 4, 2
MAX_POS = 256  # config.max_position_embeddings

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.8, "truncate": False,
    },
    # Gemma 4's global layers: a quarter of the frequencies, the other dims left as they are
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25},
}


def llama_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, rope_parameters=dict(rope),
    )


def longrope_config(partial: float = 1.0) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(
        hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POS, original_max_position_embeddings=64, partial_rotary_factor=partial,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)],
        },
    )


def hf_cos_sin(rotary: torch.nn.Module, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin [num_positions, dim] for positions 0..num_positions-1 in one sequence."""
    position_ids = torch.arange(num_positions)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), position_ids)
    return cos[0], sin[0]


def check_against_hf(rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, apply=apply_rotary_pos_emb,
                     dtype: torch.dtype = torch.float32, atol: float = 1e-5) -> None:
    num_tokens = cos.shape[0]
    gen = torch.Generator().manual_seed(0)
    positions = torch.randperm(num_tokens, generator=gen)  # a flat batch in any order
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)

    q_out, k_out = rope(positions, q, k)

    # transformers layout: [batch, heads, seq, head_dim], cos/sin [batch, seq, dim]
    c, s = cos[positions][None].to(dtype), sin[positions][None].to(dtype)
    q_ref, k_ref = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], c, s)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    rtol = 1e-5 if atol else 0.0
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=atol, rtol=rtol)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(variant: str) -> None:
    config = llama_config(VARIANTS[variant])
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, rope_parameters(config), torch.float32)

    hf_rotary = LlamaRotaryEmbedding(config)
    if variant != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
        torch.testing.assert_close(hf_rotary.inv_freq, inv_freq)
        assert hf_rotary.attention_scaling == scaling
    cos, sin = hf_cos_sin(hf_rotary, MAX_POS)
    check_against_hf(rope, cos, sin)


@pytest.mark.parametrize("max_position", [MAX_POS // 2, MAX_POS, 3 * MAX_POS])
def test_dynamic_ntk_is_fixed_for_max_position(max_position: int) -> None:
    # transformers rescales the base when a sequence outgrows max_position_embeddings; here the
    # base is fixed for the engine's max_position, so both agree on a sequence of that length.
    config = llama_config(VARIANTS["dynamic"])
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, max_position, rope_parameters(config), torch.float32)
    cos, sin = hf_cos_sin(LlamaRotaryEmbedding(config), max_position)
    check_against_hf(rope, cos, sin, atol=1e-4)  # large positions: float32 angle rounding


@pytest.mark.parametrize("max_position", [64, 128])  # short factors up to the original 64, long past it
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_matches_transformers(max_position: int, partial: float) -> None:
    config = longrope_config(partial)
    params = rope_parameters(config)
    assert params["original_max_position_embeddings"] == 64
    rope = get_rope(HEAD_DIM, max_position, config, torch.float32)
    assert rope.rotary_dim == int(HEAD_DIM * partial)

    hf_rotary = Phi3RotaryEmbedding(config)
    cos, sin = hf_cos_sin(hf_rotary, max_position)
    assert hf_rotary.attention_scaling > 1.0  # factor = 256 / 64 gives a real scaling to check
    check_against_hf(rope, cos, sin, apply=phi3_apply_rotary_pos_emb)


@pytest.mark.parametrize("rope_type", ["default", "linear"])
def test_partial_rotary(rope_type: str) -> None:
    rope_dict = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if rope_type == "linear":
        rope_dict["factor"] = 2.0
    config = StableLmConfig(
        hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POS, rope_parameters=rope_dict,
    )
    rope = get_rope(HEAD_DIM, MAX_POS, config, torch.float32)
    assert rope.rotary_dim == HEAD_DIM // 4
    cos, sin = hf_cos_sin(StableLmRotaryEmbedding(config), MAX_POS)
    assert cos.shape[-1] == HEAD_DIM // 4
    # Phi-3's apply_rotary_pos_emb is the one that rotates only the first cos.shape[-1] dims.
    check_against_hf(rope, cos, sin, apply=phi3_apply_rotary_pos_emb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_bit_exact(dtype: torch.dtype) -> None:
    config = llama_config(VARIANTS["llama3"])
    rope = get_rope(HEAD_DIM, MAX_POS, config, dtype)
    assert rope.cos_sin_cache.dtype == torch.float32
    cos, sin = hf_cos_sin(LlamaRotaryEmbedding(config), MAX_POS)
    check_against_hf(rope, cos, sin, dtype=dtype, atol=0)


def test_flat_heads_and_strided_input() -> None:
    config = llama_config(VARIANTS["default"])
    rope = get_rope(HEAD_DIM, MAX_POS, config, torch.float32)
    positions = torch.tensor([5, 0, 17])
    qkv = torch.randn(3, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q, k, _ = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q_flat, k_flat = rope(positions, q, k)
    q_3d, k_3d = rope(positions, q.reshape(3, NUM_HEADS, HEAD_DIM), k.reshape(3, NUM_KV_HEADS, HEAD_DIM))
    assert q_flat.shape == q.shape
    torch.testing.assert_close(q_flat, q_3d.reshape(q.shape), atol=0, rtol=0)
    torch.testing.assert_close(k_flat, k_3d.reshape(k.shape), atol=0, rtol=0)


def test_rope_parameters_legacy_and_new_formats() -> None:
    legacy = SimpleNamespace(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        rope_theta=1e6, max_position_embeddings=16384,
    )
    assert rope_parameters(legacy) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "rope_theta": 1e6, "max_position_embeddings": 16384,
    }
    plain = SimpleNamespace(rope_scaling=None, rope_theta=5e5, max_position_embeddings=2048, partial_rotary_factor=0.5)
    assert rope_parameters(plain) == {
        "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5, "max_position_embeddings": 2048,
    }
    new = llama_config({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0})
    params = rope_parameters(new)
    assert params["rope_type"] == "llama3" and params["original_max_position_embeddings"] == MAX_POS
    with pytest.raises(ValueError, match="unsupported rope_type"):
        rope_parameters(SimpleNamespace(rope_scaling={"type": "mrope"}, max_position_embeddings=8))


def test_get_rope_shares_one_module_per_setting() -> None:
    config = llama_config(VARIANTS["linear"])
    assert get_rope(HEAD_DIM, MAX_POS, config, torch.float32) is get_rope(HEAD_DIM, MAX_POS, config, torch.float32)
    assert get_rope(HEAD_DIM, MAX_POS, config, torch.float32) is not get_rope(HEAD_DIM, 2 * MAX_POS, config, torch.float32)
