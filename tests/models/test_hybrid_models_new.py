"""LFM2-MoE, Zamba 2 and Kimi Linear against transformers on the same random weights, through the tests of
test_hybrid_models (greedy tokens and logprobs with prompts chunked at odd points, under
preemption, with n > 1, the refusals) and of test_hybrid_prefix_cache (prefix hits resumed
from state checkpoints, n > 1 siblings, eviction)."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runtime.models.registry import choose_model
from tests.models import test_hybrid_models as base
from tests.models import test_hybrid_prefix_cache as prefix
from tests.models.test_hybrid_models_more import _assert_chunked_parity
from tests.parity import hf_greedy

# LFM2-MoE: a short conv with a dense MLP, then attention with top-2 of 4 sigmoid-routed
# experts (expert bias set below, renormalised, scaled)
LFM2_MOE = dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.5,
                tie_word_embeddings=False)

# Zamba 2: four Mamba 2 layers, the shared blocks before layers 0, 2 and 3 (block 0 used
# twice, block 1 once), each use with its q/k/v and MLP adapters; shared-block rope on.
# time_step_min lowered so that the step-size clamp, which transformers applies in prefill
# only, does not bite where a preempted request recomputes its decoded tokens as prefill
ZAMBA2 = dict(num_hidden_layers=4, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"],
              num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8,
              use_mem_rope=True, num_key_value_heads=4, n_mamba_heads=4, mamba_expand=1,
              mamba_d_state=8, mamba_ngroups=2, chunk_size=16, tie_word_embeddings=True,
              time_step_min=1e-5)

# Kimi Linear: KDA with a dense MLP, MLA without rope with top-2 of 4 experts in 2 groups (one
# kept, correction bias set below) and a shared expert, KDA with the same MoE
KIMI_LINEAR = dict(num_hidden_layers=3, num_key_value_heads=4, pad_token_id=0,
                   layer_types=["linear_attention", "full_attention", "linear_attention"],
                   mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=2,
                   linear_head_dim=16, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                   qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2,
                   moe_intermediate_size=32, num_shared_experts=1, num_expert_group=2,
                   topk_group=1, routed_scaling_factor=1.5, tie_word_embeddings=False)

CASES = {"lfm2-moe": ("Lfm2MoeForCausalLM", LFM2_MOE), "zamba2": ("Zamba2ForCausalLM", ZAMBA2),
         "kimi-linear": ("KimiLinearForCausalLM", KIMI_LINEAR)}

# the state of 4 sequences and the KV of 7 blocks (Zamba 2: 3 attention uses of 32-wide heads;
# Kimi Linear: one MLA layer's latents of 40)
PREEMPTION_BUDGET = {"lfm2-moe": "30KiB", "zamba2": "386KiB", "kimi-linear": "43520"}


def build(factory, case: str, **overrides) -> str:
    """The case's model folder (its config changed by `overrides`); the biases built as zeros
    drawn at random: the routers', so that they decide the routing, and the projections'
    (Zamba 2's with `add_bias_linear`), so that they count."""
    arch, base = CASES[case]
    path = factory(arch, **{**base, **overrides})
    weights = load_file(f"{path}/model.safetensors")
    biases = sorted(n for n in weights
                    if n.endswith(("expert_bias", "e_score_correction_bias", "proj.bias")))
    if biases:
        gen = torch.Generator().manual_seed(0)
        for name in biases:
            weights[name] = torch.randn(weights[name].shape, generator=gen)
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def hybrid_case(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hybrid_path(hybrid_case, tiny_model_factory) -> str:
    assert choose_model([CASES[hybrid_case][0]]).impl == "native"
    return build(tiny_model_factory, hybrid_case)


hybrid, chunked_llm = base.hybrid, base.chunked_llm
test_matches_transformers_with_odd_chunks = base.test_matches_transformers_with_odd_chunks
test_matches_transformers_unchunked_and_preempted = \
    base.test_matches_transformers_unchunked_and_preempted
test_parallel_samples_follow_the_prompt = base.test_parallel_samples_follow_the_prompt
test_state_larger_than_the_budget_is_refused = base.test_state_larger_than_the_budget_is_refused


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tiny_model_factory):
    """(model folder, transformers' greedy references for the prefix-cache prompts)."""
    path = build(tiny_model_factory, request.param)
    hf = getattr(transformers, CASES[request.param][0]).from_pretrained(
        path, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, prefix.MAX_NEW) for p in prefix.PROMPTS]


llm = prefix.llm
test_shared_prefix_hits_and_matches_transformers = \
    prefix.test_shared_prefix_hits_and_matches_transformers
test_parallel_samples_resume_from_the_leader = prefix.test_parallel_samples_resume_from_the_leader
test_eviction_drops_checkpoints = prefix.test_eviction_drops_checkpoints


def test_zamba2_untied_uses_keep_their_own_blocks(tiny_model_factory):
    """Without `tie_word_embeddings` transformers ties nothing: each use of a shared block
    runs weights of its own. Also: no q/k/v adapters, fewer KV heads than query heads, the
    default time_step_min, whose clamp bites in prefill."""
    arch = "Zamba2ForCausalLM"
    path = tiny_model_factory(arch, **dict(
        ZAMBA2, tie_word_embeddings=False, use_shared_attention_adapter=False,
        num_key_value_heads=2, use_mem_rope=False, time_step_min=0.001,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]))
    _assert_chunked_parity(path, arch)
