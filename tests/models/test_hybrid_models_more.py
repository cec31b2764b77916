"""More native hybrids against transformers on the same random weights, through the tests of
test_hybrid_models (greedy tokens and logprobs with prompts chunked at odd points, under
preemption, with n > 1, and the refusals), each on every layer type of its architecture."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM
from tests.models import test_hybrid_models as base
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

# Nemotron-H: Mamba 2, squared-ReLU experts (top-2 of 8 in 2 groups, one group kept, a
# shared expert), attention without rope, a squared-ReLU MLP
NEMOTRON_H = dict(layer_types=["linear_attention", "moe", "full_attention", "mlp"],
                  mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                  chunk_size=16, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                  topk_group=1, routed_scaling_factor=1.5)

# Falcon-H1 (mixer and attention side by side in each layer), every muP multiplier away from 1
FALCON_H1 = dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                 mamba_d_state=16, mamba_chunk_size=16, embedding_multiplier=2.0,
                 lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=0.6,
                 attention_in_multiplier=1.2, attention_out_multiplier=0.8,
                 ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], ssm_in_multiplier=1.1,
                 ssm_out_multiplier=0.9, tie_word_embeddings=False)

CASES = {
    # Mamba 1 only: no attention
    "mamba": ("MambaForCausalLM", dict(state_size=16, expand=2, tie_word_embeddings=False)),
    # Jamba: Mamba 1 (layers 0, 2) and attention without rope (1, 3); experts in layers 0
    # and 3, so each of mixer and attention comes with an MLP and with a top-2 MoE
    "jamba": ("JambaForCausalLM", dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=3,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16)),
    "nemotron-h": ("NemotronHForCausalLM", NEMOTRON_H),
    # its mixer's gated norm on, normed before the gate
    "falcon-h1": ("FalconH1ForCausalLM", dict(FALCON_H1, mamba_rms_norm=True)),
}

# the state of 4 sequences and, where there is attention, the KV of 7 blocks
PREEMPTION_BUDGET = {"mamba": "80KiB", "jamba": "132KiB", "nemotron-h": "69KiB",
                     "falcon-h1": "138KiB"}


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


def _assert_chunked_parity(path: str, arch: str) -> None:
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=13,
              block_size=16)
    assert_matches_hf(llm.generate(PROMPTS, base.GREEDY),
                      [hf_greedy(hf, p, base.MAX_NEW) for p in PROMPTS])


def test_nemotron_h_clamps_prefill_steps_only(tiny_model_factory):
    """Transformers clamps Nemotron-H's step sizes to time_step_limit in prefill and not in
    decode; its lower end is raised here so that the clamp bites. The experts here run in a
    latent space, their top-k weights not renormalised."""
    arch = "NemotronHForCausalLM"
    path = tiny_model_factory(arch, **NEMOTRON_H, time_step_limit=(0.05, float("inf")),
                              moe_latent_size=32, norm_topk_prob=False)
    _assert_chunked_parity(path, arch)


def test_falcon_h1_without_the_mixer_norm(tiny_model_factory):
    """Falcon-H1's default: the scan's output only gated by silu(gate), no norm."""
    arch = "FalconH1ForCausalLM"
    _assert_chunked_parity(tiny_model_factory(arch, **FALCON_H1), arch)


def test_mamba2_in_bfloat16_keeps_the_residual_in_float32(tiny_model_factory):
    """In bfloat16 transformers keeps Mamba 2's residual stream in float32
    (`residual_in_fp32`): the same greedy tokens need the same (with a bfloat16 residual,
    two of these prompts diverge)."""
    arch, overrides = base.CASES["mamba2"]
    path = tiny_model_factory(arch, **overrides)
    hf = transformers.Mamba2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="8MiB", max_num_batched_tokens=13,
              block_size=16)
    outputs = llm.generate(PROMPTS, base.GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == \
        [hf_greedy(hf, p, base.MAX_NEW)[0] for p in PROMPTS]
