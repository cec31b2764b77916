"""More native hybrids against transformers on the same random weights, through the tests of
test_hybrid_models (greedy tokens and logprobs with prompts chunked at odd points, under
preemption, with n > 1, and the refusals), each on every layer type of its architecture."""
from __future__ import annotations

import pytest

from tests.models import test_hybrid_models as base

CASES = {
    # Mamba 1 only: no attention
    "mamba": ("MambaForCausalLM", dict(state_size=16, expand=2, tie_word_embeddings=False)),
    # Jamba: Mamba 1 (layers 0, 2) and attention without rope (1, 3); experts in layers 0
    # and 3, so each of mixer and attention comes with an MLP and with a top-2 MoE
    "jamba": ("JambaForCausalLM", dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=3,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16)),
}

# the state of 4 sequences and, where there is attention, the KV of 7 blocks
PREEMPTION_BUDGET = {"mamba": "80KiB", "jamba": "132KiB"}


@pytest.fixture(scope="module", params=sorted(CASES))
def hybrid_case(request) -> str:
    return request.param


hybrid_path, hybrid, chunked_llm = base.hybrid_path, base.hybrid, base.chunked_llm
test_matches_transformers_with_odd_chunks = base.test_matches_transformers_with_odd_chunks
test_matches_transformers_unchunked_and_preempted = \
    base.test_matches_transformers_unchunked_and_preempted
test_parallel_samples_follow_the_prompt = base.test_parallel_samples_follow_the_prompt
test_state_larger_than_the_budget_is_refused = base.test_state_larger_than_the_budget_is_refused
test_what_hybrids_cannot_run_is_refused_by_name = \
    base.test_what_hybrids_cannot_run_is_refused_by_name
