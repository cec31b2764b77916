"""Native Gemma 2, Gemma 3 (text), Phi-3 and the MoE models against transformers on the same random weights:
greedy tokens and logprobs, on the default CPU backend and the portable one."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.models.registry import choose_model
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 12
HEAD = dict(head_dim=16, tie_word_embeddings=False)

CASES = {
    # soft-capped attention and logits, alternating sliding (8) and global layers
    "gemma2": ("Gemma2ForCausalLM", dict(
        HEAD, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0)),
    # q/k norms, a rope per layer type (linear scaling on the global layers)
    "gemma3": ("Gemma3ForCausalLM", dict(
        HEAD, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # fused qkv_proj / gate_up_proj checkpoint, LongRoPE short factors
    "phi3": ("Phi3ForCausalLM", dict(
        HEAD, original_max_position_embeddings=1024, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [2.0] * 8})),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a gated shared expert, top-k weights not renormalised, layer 1 dense
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True)),
}

RUNS = [(case, None) for case in sorted(CASES)] + [("gemma2", "torch_paged")]


@pytest.mark.parametrize("case,backend", RUNS)
def test_native_model_matches_transformers(case, backend, tiny_model_factory):
    arch, overrides = CASES[case]
    path = tiny_model_factory(arch, **overrides)
    assert choose_model([arch]).impl == "native"
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=32,
              block_size=8, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)


def test_moe_tensor_parallel_matches_one_rank(tiny_model_factory):
    """Two ranks (one process each): heads, the shared expert's columns and every expert's
    intermediate dimension split; the same tokens as one rank."""
    arch, overrides = CASES["qwen2-moe"]
    path = tiny_model_factory(arch, **overrides)
    engine = dict(dtype="float32", kv_cache_memory="8MiB", num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = PROMPTS[:3]
    single = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, params)]
    llm = LLM(path, tensor_parallel_size=2, **engine)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == single


def test_phi3_longrope_short_factors_within_the_original_context(tiny_model_factory):
    """A long-context checkpoint (original context 64, 256 positions) served with
    max_model_len 64: transformers rotates such sequences with the short factors, and so must
    the engine, whose rotary covers max_model_len."""
    path = tiny_model_factory("Phi3ForCausalLM", **dict(
        HEAD, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [4.0, 6.0, 9.0, 12.0, 16.0, 20.0, 24.0, 32.0]}))
    hf = transformers.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p for p in PROMPTS if len(p) + MAX_NEW <= 64]
    references = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(prompts, params), references)
