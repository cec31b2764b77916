"""Native DeepSeek-V3 and V2 (MLA, grouped top-k MoE) against transformers on the same random
weights: greedy tokens and logprobs with chunked prefill, prefix caching and preemption, on each
MLA backend the CPU offers, and with tensor parallel."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 10
TINY_LAYERS = 2
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
           num_attention_heads=4, num_key_value_heads=4)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
CASES = {
    # q LoRA, 4 expert groups of which 2 are kept, YaRN with mscale (softmax scale and cos/sin)
    "v3": ("DeepseekV3", dict(MLA, **MOE, q_lora_rank=48, n_group=4, topk_group=2,
                              rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
        mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    # Kimi K2's shape: no q LoRA, one group, unnormalised top-k weights
    "kimi": ("DeepseekV3", dict(MLA, **MOE, q_lora_rank=None, n_group=1, topk_group=1,
                                norm_topk_prob=False)),
    # softmax routing limited to the 2 best of 4 groups, no correction bias
    "v2": ("DeepseekV2", dict(MLA, **MOE, q_lora_rank=None, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy")),
}


def build_deepseek(path: str, tokenizer_dir: str, family: str, overrides: dict) -> str:
    """A random `family`ForCausalLM with a random `e_score_correction_bias` where it has one
    (transformers initialises it to zeros, which would not test it)."""
    from tests.conftest import TINY
    config = getattr(transformers, f"{family}Config")(vocab_size=49152, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory, tokenizer_dir):
    """case -> (folder, transformers' greedy tokens and logprobs), built on first use."""
    built: dict = {}

    def get(case: str):
        if case not in built:
            family, overrides = CASES[case]
            path = build_deepseek(str(tmp_path_factory.mktemp(case)), tokenizer_dir, family,
                                  overrides)
            hf = getattr(transformers, f"{family}ForCausalLM").from_pretrained(
                path, dtype=torch.float32).eval()
            built[case] = path, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        return built[case]

    return get


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


BLOCK_SIZE = 8
NUM_BLOCKS = 16  # the 90-token prompt needs 13: the batch preempts


@pytest.mark.parametrize("case,backend", [(case, backend) for case in ("v3", "kimi")
                                          for backend in ("cpu_mla", "torch_mla")]
                         + [("v2", "cpu_mla")])
def test_deepseek_matches_transformers(deepseek_models, case, backend):
    """Chunks of 32 tokens (the 37- and 90-token prompts prefill in several steps), a cache
    of few blocks (preemption), and the prompts again (prefix caching)."""
    path, references = deepseek_models(case)
    latent = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    per_block = TINY_LAYERS * BLOCK_SIZE * latent * 4  # one float32 latent per token and layer
    llm = LLM(path, dtype="float32", kv_cache_memory=NUM_BLOCKS * per_block,
              max_num_batched_tokens=32, block_size=BLOCK_SIZE, attention_backend=backend,
              enable_prefix_caching=True)
    core = llm.engine.core
    assert core.model_config.kv_bytes_per_block(BLOCK_SIZE, torch.float32) == per_block
    assert core.num_blocks == NUM_BLOCKS
    assert_matches_hf(llm.generate(PROMPTS, PARAMS), references)
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert_matches_hf(llm.generate(PROMPTS[:2], PARAMS), references[:2])
    assert core.kv.num_cache_hits > 0, "the repeated prompts were meant to hit"


def test_deepseek_v3_tensor_parallel_matches_transformers(deepseek_models):
    """Two ranks (gloo, one process each): two heads and their kv_b_proj rows per rank, the
    latent replicated, every expert's and the shared expert's intermediate dimension split."""
    path, references = deepseek_models("v3")
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2,
              num_threads=1)
    try:
        assert_matches_hf(llm.generate(PROMPTS, PARAMS), references)
    finally:
        llm.engine.core.shutdown()


def test_a_kv_attention_backend_is_refused_for_mla(deepseek_models):
    """An MLA model is offered the MLA backends only; forcing another names them."""
    path, _ = deepseek_models("kimi")
    with pytest.raises(ValueError, match="'cpu_paged'.*not offered on platform 'cpu'; known: "
                                         "cpu_mla, torch_mla"):
        LLM(path, dtype="float32", kv_cache_memory="1MiB", attention_backend="cpu_paged")
