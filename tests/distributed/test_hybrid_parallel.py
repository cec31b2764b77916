"""Tensor and pipeline parallel for hybrid models on the CPU (gloo, one worker process per
rank): the recurrent layers' heads and channels split over two ranks, or their layers over two
stages, give one rank's greedy tokens and logprobs, with prompts chunked mid-block and prefix
hits resuming from each rank's share of the checkpointed state."""
from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from tests.models.test_hybrid_models import CASES
from tests.models.test_hybrid_models_more import CASES as MORE_CASES
from tests.models.test_hybrid_models_new import CASES as NEW_CASES, build
from tests.parity import LOGPROB_ATOL

MAX_NEW = 6
# a 70-token prefix shared by prompts of different tails: the second resumes after 64 tokens,
# the third mid-block at 32
PREFIX = [1] + list(range(400, 469))
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + list(range(900, 920)), PREFIX[:40] + [5, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=24,
              block_size=16, max_num_seqs=8, num_threads=1)

# (model, overrides of its hybrid test case, tp, pp, engine options): each tp = 2 engine costs
# seconds, so the other mixers (LFM2's short conv, Mamba 1) are split against the whole layer
# in tests/layers/test_recurrent_sharding.py
PARALLEL = {
    # gated delta-nets: one key head and two value heads per rank
    "qwen3.5-tp2": ("qwen3.5", {}, 2, 1, {}),
    # Mamba 2 with one group of B and C: replicated on both ranks, the gated norm's variance
    # all-reduced over the ranks
    "bamba-tp2-one-group": ("bamba", dict(mamba_n_groups=1), 2, 1, {}),
    # the short conv on stage 0, attention on stage 1
    "lfm2-pp2": ("lfm2", {}, 1, 2, {}),
    # Mamba 2 and the experts on stage 0, attention and the MLP on stage 1
    "nemotron-h-pp2": ("nemotron-h", {}, 1, 2, {}),
    # the ungated experts' intermediate split, summed over the ranks
    "nemotron-h-tp2": ("nemotron-h", {}, 2, 1, {}),
    # the short conv and dense MLP, then attention and the fused experts split by
    # intermediate; and the same layers over two stages
    "lfm2-moe-tp2": ("lfm2-moe", {}, 2, 1, {}),
    "lfm2-moe-pp2": ("lfm2-moe", {}, 1, 2, {}),
    # KDA, MLA and the experts on stage 0, KDA and the experts on stage 1
    "kimi-linear-pp2": ("kimi-linear", {}, 1, 2, {}),
    # one KDA head per rank (its conv channels, decay and gate rows), MLA's heads, the experts
    # and the shared expert split by intermediate
    "kimi-linear-tp2": ("kimi-linear", {}, 2, 1, {}),
    # no attention: neither stage keeps KV; in bfloat16 the float32 residual stream crosses
    # between the stages beside the hidden states (pipeline parallel changes no arithmetic,
    # so the tokens and logprobs equal one rank's in any dtype)
    "mamba2-pp2-bf16": ("mamba2", {}, 1, 2, dict(dtype="bfloat16")),
    # Zamba 2's shared blocks (block 0 used by layers 0 and 3, block 1 by layer 2): two of
    # four attention heads and their q/k/v adapters' rows per rank, the MLP's gate and up
    # halves and their adapters' by intermediate, the Mamba 2 groups split
    "zamba2-tp2": ("zamba2", {}, 2, 1, {}),
    # block 0 built on both stages (stage 1 loads it, and use 2's adapters, from layer 0's
    # names), the token embeddings sent on with the hidden states
    "zamba2-pp2": ("zamba2", {}, 1, 2, {}),
    # untied: each use its own block; the MLP's and Mamba's biases (the row-parallel
    # down_proj's added once), KV heads fewer than query heads, no q/k/v adapters
    "zamba2-untied-tp2": ("zamba2", dict(tie_word_embeddings=False, add_bias_linear=True,
                                         use_shared_attention_adapter=False,
                                         num_key_value_heads=2), 2, 1, {}),
}


def _path(factory, model: str, overrides: dict) -> str:
    if model in NEW_CASES:
        return build(factory, model, **overrides)
    arch, base = {**CASES, **MORE_CASES}[model]
    return factory(arch, **{**base, **overrides})


def _run(llm: LLM) -> list:
    return [llm.generate([p], GREEDY)[0] for p in PROMPTS]


@pytest.mark.parametrize("case", list(PARALLEL))
def test_parallel_hybrid_matches_one_rank(case, tiny_model_factory):
    model, overrides, tp, pp, options = PARALLEL[case]
    path = _path(tiny_model_factory, model, overrides)
    engine = {**ENGINE, **options}
    single = _run(LLM(path, **engine))
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine)
    try:
        outputs = _run(llm)
    finally:
        llm.engine.core.shutdown()
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 32]
    for ours, one in zip(outputs, single):
        assert ours.outputs[0].token_ids == one.outputs[0].token_ids
        gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
                for a, b in zip(ours.outputs[0].logprobs, one.outputs[0].logprobs)]
        assert max(gaps) < LOGPROB_ATOL
