"""Native hybrid models (recurrent layers beside attention) against transformers on the same
random weights: greedy tokens and logprobs, with prompts chunked at odd points, under a KV
budget that forces preemption, and with n > 1."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.model_config import RECURRENT_LAYER_TYPES
from runtime.models.registry import choose_model
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 10

# three gated delta-nets (two value heads per key head), then gated attention with a quarter
# of each head rotated
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)

CASES = {
    "qwen3.5": ("Qwen3_5ForCausalLM", HYBRID),
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", dict(HYBRID, **MOE)),
    # the delta-net projections grouped per key head; layer 1 dense, top-k not renormalised
    "qwen3-next": ("Qwen3NextForCausalLM", dict(HYBRID, **MOE, mlp_only_layers=[1],
                                                norm_topk_prob=False)),
    # no attention at all; two groups of B and C, SSD chunks of 16 tokens
    "mamba2": ("Mamba2ForCausalLM", dict(
        num_hidden_layers=2, expand=2, num_heads=8, head_dim=16, n_groups=2, state_size=16,
        chunk_size=16)),
    # Granite 4.0-H: a Mamba 2 layer and an attention layer without rope, top-2 of 4 experts
    # and a shared MLP, every multiplier away from 1
    "granite-4.0-h": ("GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=2.0, tie_word_embeddings=False)),
    # Bamba: a Mamba 2 layer, then attention rotating half of each head
    "bamba": ("BambaForCausalLM", dict(
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16, tie_word_embeddings=False)),
    # LFM2: a short gated conv (width 3), then attention with q/k norms
    "lfm2": ("Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"],
                                     tie_word_embeddings=False)),
}


# the budget that holds the state of 4 sequences and the KV of 7 blocks: a request of
# max_model_len 100 fits alone, not all of them at once (Mamba 2 keeps no KV)
PREEMPTION_BUDGET = {"bamba": "69KiB", "lfm2": "30KiB", "qwen3.5": "94KiB", "qwen3.5-moe": "94KiB", "qwen3-next": "94KiB",
                     "granite-4.0-h": "69KiB", "mamba2": "94KiB"}


@pytest.fixture(scope="module", params=sorted(CASES))
def hybrid_case(request) -> str:
    return request.param


# The fixtures and tests below read CASES and PREEMPTION_BUDGET from the module that runs them,
# so that tests/models/test_hybrid_models_more.py runs them on its own architectures.
@pytest.fixture(scope="module")
def hybrid_path(hybrid_case, tiny_model_factory, request) -> str:
    arch, overrides = request.module.CASES[hybrid_case]
    assert choose_model([arch]).impl == "native"
    return tiny_model_factory(arch, **overrides)


@pytest.fixture(scope="module")
def hybrid(hybrid_case, hybrid_path, request):
    """(model folder, transformers' greedy references for PROMPTS)."""
    arch = request.module.CASES[hybrid_case][0]
    hf = getattr(transformers, arch).from_pretrained(hybrid_path, dtype=torch.float32).eval()
    return hybrid_path, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def chunked_llm(hybrid_path) -> LLM:
    """A 13-token budget: the longer prompts are split at odd positions."""
    return LLM(hybrid_path, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=13,
               block_size=16)


def test_matches_transformers_with_odd_chunks(hybrid, chunked_llm):
    """The state carries over from one prompt chunk to the next."""
    assert_matches_hf(chunked_llm.generate(PROMPTS, GREEDY), hybrid[1])


def test_matches_transformers_unchunked_and_preempted(hybrid, hybrid_case, request):
    """Whole prompts in one step, and a KV cache too small for every request at once: the
    preempted ones give up their state slot and recompute."""
    path, references = hybrid
    llm = LLM(path, dtype="float32",
              kv_cache_memory=request.module.PREEMPTION_BUDGET[hybrid_case], max_num_seqs=4,
              enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=100,
              block_size=16)
    outputs = llm.generate(PROMPTS, GREEDY)
    layer_types = llm.engine.core.model_config.layer_types
    if set(layer_types) - set(RECURRENT_LAYER_TYPES):  # Mamba 2 keeps no KV: nothing runs out
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches_hf(outputs, references)


def test_parallel_samples_follow_the_prompt(hybrid, chunked_llm):
    """n = 3 greedy samples each equal transformers' greedy continuation."""
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for out, (tokens, _) in zip(chunked_llm.generate(PROMPTS[:2], params), hybrid[1]):
        assert [s.token_ids for s in out.outputs] == [tokens] * 3


def test_state_larger_than_the_budget_is_refused(hybrid_path):
    with pytest.raises(ValueError, match="recurrent state of 256 sequences .* does not fit"):
        LLM(hybrid_path, dtype="float32", kv_cache_memory="64KiB")


@pytest.mark.parametrize("engine, named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding is not supported for .* recurrent layers"),
    (dict(enable_lora=True), "--enable-lora is not supported"),
    (dict(runner="pooling"), "pooling runner is not supported"),
])
def test_what_hybrids_cannot_run_is_refused_by_name(hybrid_path, engine, named):
    with pytest.raises(ValueError, match=named):
        LLM(hybrid_path, dtype="float32", kv_cache_memory="8MiB", **engine)
