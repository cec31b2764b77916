"""Speculative decoding end to end: greedy output is exactly plain greedy's, sampled output is
distributed as plain sampling's, rejected proposals leave no trace in the KV cache."""
from __future__ import annotations

import pytest
from scipy.stats import chi2_contingency

from parity import PROMPTS
from runtime import LLM, SamplingParams

REPEATING = [[1, 5, 6, 7, 8] * 6, [1] + [300, 301, 302] * 9]
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=64)


def generate(model: str, prompts: list, params, spec: dict | None = None, **engine):
    llm = LLM(model, speculative_config=spec, **{**ENGINE, **engine})
    outputs = llm.generate(prompts, params)
    pool = llm.engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    return outputs, llm.engine.core.scheduler.spec_stats


def tokens_and_logprobs(outputs) -> tuple[list[list[int]], list[list[float]]]:
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs]
    return tokens, logprobs


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return tokens_and_logprobs(generate(target, PROMPTS + REPEATING, GREEDY)[0])


@pytest.mark.parametrize("spec", ["ngram", "random_draft", "truncated_draft", "self_draft"])
def test_greedy_speculation_gives_the_tokens_of_plain_greedy(spec, plain_greedy, target,
                                                             request):
    if spec == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    else:
        draft = target if spec == "self_draft" else request.getfixturevalue(spec)
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    outputs, stats = generate(target, PROMPTS + REPEATING, GREEDY, config)
    tokens, logprobs = tokens_and_logprobs(outputs)
    assert tokens == plain_greedy[0]
    for ours, ref in zip(logprobs, plain_greedy[1]):
        assert ours == pytest.approx(ref, abs=1e-3)
    assert stats.num_draft_tokens > 0
    if spec == "self_draft":  # the target proposes what it then verifies: all accepted
        assert stats.acceptance_rate == 1.0


def test_ngram_acceptance_on_self_repeating_output(bigram_model):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 40, 41, 42] * 4, [1, 7, 9] * 5, [1, 300]]
    plain, _ = generate(bigram_model, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    outputs, stats = generate(bigram_model, prompts, params, spec)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert stats.acceptance_rate > 0.5
    assert stats.mean_accepted_length > 2.0


def _first_tokens(outputs, position: int) -> list[int]:
    return [o.outputs[0].token_ids[position] for o in outputs]


def _same_distribution(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test; tokens seen fewer than 10 times are pooled."""
    counts: dict[int, list[int]] = {}
    for column, sample in enumerate((a, b)):
        for t in sample:
            counts.setdefault(t, [0, 0])[column] += 1
    table, other = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            table.append(pair)
        else:
            other = [other[0] + pair[0], other[1] + pair[1]]
    if sum(other):
        table.append(other)
    return chi2_contingency(table).pvalue


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_with_speculation_keeps_the_distribution(method, small_vocab_target,
                                                          small_vocab_draft, bigram_model):
    """Seeded, so deterministic: 400 samples of the first three tokens with and without
    speculation must not be told apart (two-sample chi-square per position)."""
    if method == "ngram":
        model, spec = bigram_model, {"method": "ngram", "num_speculative_tokens": 3}
        # the model's own greedy cycle, which sampling tends to continue
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        prompt = [1, 40] + generate(model, [[1, 40]], greedy)[0][0].outputs[0].token_ids
    else:
        model = small_vocab_target
        spec = {"method": "draft_model", "model": small_vocab_draft, "num_speculative_tokens": 2}
        prompt = [1, 17, 18, 19]
    draws = 400
    params = [SamplingParams(temperature=0.8, top_k=12, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(draws)]
    plain, _ = generate(model, [prompt] * draws, params, max_num_seqs=256)
    outputs, stats = generate(model, [prompt] * draws, params, spec, max_num_seqs=256)
    assert 0.05 < stats.acceptance_rate < 0.95  # both paths taken: accepted and rejected
    for position in range(3):
        pvalue = _same_distribution(_first_tokens(plain, position),
                                    _first_tokens(outputs, position))
        assert pvalue > 1e-3, f"position {position}: p = {pvalue:.2e}"
