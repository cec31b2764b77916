"""Native Granite, GraniteMoe, Llama 4 text and Gemma 4 against transformers on the same random
weights: greedy tokens and logprobs, with chunked prefill (32-token steps), prefix caching (the
last prompt repeats the second's 37 tokens) and preemption (a cache of 40 blocks of 4 tokens)
asserted; and each MoE class loading a per-expert checkpoint as it loads the stacked one."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.model_config import attention_heads
from runtime.models.registry import choose_model
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 40
PARITY_PROMPTS = PROMPTS + [PROMPTS[1] + [5, 6, 7]]
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
GRANITE = dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.4,
               logits_scaling=4.0, tie_word_embeddings=False)

CASES = {
    # sliding (8) and global layers, global ones with twice the head size, one KV head whose
    # values are its keys; the last two layers read the first two's KV (with a double-wide
    # MLP); per-layer embeddings; proportional rope on the global layers; logit soft-cap
    "gemma4": ("Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_hidden_layers=4, sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=49152, final_logit_softcapping=10.0,
        tie_word_embeddings=False)),
    # the same with two of four experts beside every layer's MLP
    "gemma4-moe": ("Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_hidden_layers=4, sliding_window=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=49152, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=False)),
    "granite": ("GraniteForCausalLM", GRANITE),
    "granite-moe": ("GraniteMoeForCausalLM", dict(GRANITE, num_local_experts=4,
                                                  num_experts_per_tok=2)),
    # layer 0: rope, L2 q/k norm, chunks of 8 positions, dense MLP; layer 1: NoPE with
    # temperature tuning (floor_scale 4: the scale grows within the prompts), full attention,
    # two of four sigmoid-routed experts and the shared expert
    "llama4": ("Llama4ForCausalLM", dict(
        head_dim=16, intermediate_size=32, intermediate_size_mlp=128, no_rope_layers=[1, 0],
        moe_layers=[1], attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
}


def kv_cache_bytes(llm_config) -> int:
    """NUM_BLOCKS blocks of BLOCK_SIZE float32 tokens over the K and V of every layer that
    keeps its own (Gemma 4's KV-shared layers do not), each with its own head size."""
    text = llm_config.get_text_config()
    modes = getattr(text, "kv_sharing_modes", None) or [None] * text.num_hidden_layers
    widths = [kv_heads * head_size
              for i, (_, kv_heads, head_size) in enumerate(
                  attention_heads(text, i) for i in range(text.num_hidden_layers))
              if modes[i] != "reuse"]
    return NUM_BLOCKS * BLOCK_SIZE * 2 * sum(widths) * 4


@pytest.fixture(scope="module")
def parity_model(tiny_model_factory):
    """case -> (folder, its transformers references)."""
    built = {}

    def make(case: str):
        if case not in built:
            arch, overrides = CASES[case]
            path = tiny_model_factory(arch, **overrides)
            hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
            built[case] = path, hf.config, [hf_greedy(hf, p, MAX_NEW) for p in PARITY_PROMPTS]
        return built[case]

    return make


def generate(path: str, kv_bytes: int):
    llm = LLM(path, dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=kv_bytes,
              max_num_batched_tokens=32, max_model_len=128)
    return llm, llm.generate(PARITY_PROMPTS, PARAMS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_matches_transformers(case, parity_model):
    path, config, references = parity_model(case)
    assert choose_model(config.architectures).impl == "native"
    llm, outputs = generate(path, kv_cache_bytes(config))
    assert_matches_hf(outputs, references)
    core = llm.engine.core
    # every layer's cache sized with its own heads, the KV-shared ones holding none
    assert core.executor.worker.kv_bytes_per_block == core.model_config.kv_bytes_per_block(
        BLOCK_SIZE, torch.float32)
    assert core.num_blocks == NUM_BLOCKS
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert core.kv.num_cache_hits > 0, "the shared prefix was meant to hit"


def split_experts(src: str, dst: str, stacked: dict[str, tuple[str, bool]]) -> None:
    """Copy the folder `src` to `dst` with every stacked expert tensor (name suffix -> (the
    per-expert prefix, whether it is stored [E, in, out])) written one tensor per expert and
    projection, `experts.{j}.gate_proj.weight` ..., as older checkpoints store them."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        suffix = next((s for s in stacked if name.endswith(s)), None)
        if suffix is None:
            out[name] = tensor
            continue
        prefix, transposed = stacked[suffix]
        base = name[:-len(suffix)] + prefix
        for j, expert in enumerate(tensor):
            expert = expert.t() if transposed else expert
            if suffix.endswith("down_proj") or "output" in suffix:
                out[f"{base}.{j}.down_proj.weight"] = expert.contiguous()
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f"{base}.{j}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{j}.up_proj.weight"] = up.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


PER_EXPERT = {
    "gemma4-moe": {"experts.gate_up_proj": ("experts", False),
                   "experts.down_proj": ("experts", False)},
    "llama4": {"feed_forward.experts.gate_up_proj": ("feed_forward.experts", True),
               "feed_forward.experts.down_proj": ("feed_forward.experts", True)},
    "granite-moe": {"block_sparse_moe.input_linear.weight": ("block_sparse_moe.experts", False),
                    "block_sparse_moe.output_linear.weight": ("block_sparse_moe.experts", False)},
}


@pytest.mark.parametrize("case", sorted(PER_EXPERT))
def test_per_expert_checkpoint_loads_as_the_stacked_one(case, parity_model, tmp_path):
    path, config, references = parity_model(case)
    split = str(tmp_path / "per-expert")
    split_experts(path, split, PER_EXPERT[case])
    names = load_file(os.path.join(split, "model.safetensors")).keys()
    assert any(".experts.3.down_proj.weight" in n for n in names)
    _, outputs = generate(split, 64 * 2**20)
    assert_matches_hf(outputs, references)
