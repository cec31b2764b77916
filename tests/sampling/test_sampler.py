import math

import pytest
import torch

from runtime.sampling import Sampler, SamplingBatch, gather_logprobs
from runtime.sampling.penalties import apply_penalties
from runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
sampler = Sampler()


def build(params, prompts=None, outputs=None, generators=None, vocab_size=10):
    n = len(params)
    return SamplingBatch.build(params, prompts or [[]] * n, outputs or [[]] * n,
                               generators or [None] * n, CPU, vocab_size)


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# A small vocabulary with well separated probabilities, so filter boundaries are unambiguous.
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.03, 0.02, 0.015, 0.005])
LOGITS = PROBS.log()


def reference_distribution(p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p the plain way, one token at a time."""
    probs = (LOGITS / p.temperature).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:p.top_k] if p.top_k > 0 else order)
    total = sum(probs[i] for i in keep)
    nucleus, mass = set(), 0.0
    for i in order:
        if i in keep and mass < p.top_p:
            nucleus.add(i)
            mass += probs[i] / total
    top = max(probs)
    allowed = [i for i in nucleus if probs[i] >= p.min_p * top]
    out = torch.zeros(len(probs))
    out[allowed] = torch.tensor([probs[i] for i in allowed])
    return out / out.sum()


def draw(params: SamplingParams, num: int = 100000) -> torch.Tensor:
    # enough draws that a token of probability 1.3e-4 (t=0.5's tail) is missed with p < 1e-5
    torch.manual_seed(0)
    batch = build([params] * num)
    tokens = sampler(LOGITS.expand(num, -1), batch).sampled_token_ids
    return torch.bincount(tokens, minlength=len(PROBS)).float() / num


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(top_k=3),
    SamplingParams(top_k=-1),
    SamplingParams(top_p=0.75),
    SamplingParams(top_p=0.05),
    SamplingParams(min_p=0.3),
    SamplingParams(top_k=6, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.2),
], ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_support_and_distribution(params):
    expected = reference_distribution(params)
    empirical = draw(params)
    assert torch.equal(empirical > 0, expected > 0), (empirical, expected)
    torch.testing.assert_close(empirical, expected, atol=0.015, rtol=0)


@pytest.mark.parametrize("params", [
    [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5)],
    [SamplingParams(top_k=4), SamplingParams(temperature=0.5), SamplingParams(top_k=2)],  # top-k only path
], ids=["sorted", "topk-only"])
def test_rows_without_a_filter_are_unaffected(params):
    torch.manual_seed(1)
    num = 10000
    batch = build([p for p in params for _ in range(num)])
    tokens = sampler(LOGITS.expand(len(params) * num, -1), batch).sampled_token_ids.view(len(params), num)
    for p, row in zip(params, tokens):
        empirical = torch.bincount(row, minlength=len(PROBS)).float() / num
        expected = reference_distribution(p)
        assert torch.equal(empirical > 0, expected > 0)
        torch.testing.assert_close(empirical, expected, atol=0.02, rtol=0)


def test_greedy_is_argmax_and_input_untouched():
    logits = torch.randn(6, 1000)
    before = logits.clone()
    batch = build([SamplingParams(temperature=0)] * 6, vocab_size=1000)
    assert batch.all_greedy and batch.temperature is None and batch.top_k is None
    assert torch.equal(sampler(logits, batch).sampled_token_ids, logits.argmax(-1))
    mixed = build([SamplingParams(temperature=0), SamplingParams(top_k=5, top_p=0.5, min_p=0.1)] * 3,
                  vocab_size=1000)
    out = sampler(logits, mixed).sampled_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    assert torch.equal(logits, before)


def test_bfloat16_logits():
    logits = torch.randn(3, 50).bfloat16()
    out = sampler(logits, build([SamplingParams(temperature=0)] * 3, vocab_size=50))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))


def test_plain_greedy_rows_take_the_argmax_of_the_logits_as_they_come():
    """No float32 copy of bf16 logits when nothing adjusts them: widening is exact."""
    seen = []

    def argmax(x):
        seen.append(x.dtype)
        return x.max(dim=-1).indices

    logits = torch.randn(4, 64).bfloat16()
    plain = Sampler(greedy_argmax=argmax)(logits, build([SamplingParams(temperature=0)] * 4,
                                                        vocab_size=64))
    assert seen == [torch.bfloat16]
    assert torch.equal(plain.sampled_token_ids, logits.float().argmax(-1))
    biased = SamplingParams(temperature=0, logit_bias={3: 100.0})
    out = Sampler(greedy_argmax=argmax)(logits, build([biased] * 4, vocab_size=64))
    assert seen[-1] == torch.float32 and out.sampled_token_ids.tolist() == [3] * 4
    asks = SamplingParams(temperature=0, logprobs=2)
    assert Sampler(greedy_argmax=argmax)(logits, build([asks] * 4, vocab_size=64)).logprobs \
        is not None and seen[-1] == torch.float32


def test_unused_stages_are_skipped():
    batch = build([SamplingParams(), SamplingParams(temperature=0, top_k=3, repetition_penalty=1.0)])
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.repetition_penalty is None and batch.frequency_penalty is None
    assert batch.output_counts is None and batch.banned_rows is None and batch.max_num_logprobs is None


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab, steps = 300, 5
    torch.manual_seed(0)
    logits = [torch.randn(vocab) for _ in range(steps)]
    target = SamplingParams(seed=1234, top_p=0.95, top_k=100)

    def run(others_before, others_after):
        rows = others_before + [target] + others_after
        gens = [seeded(p.seed) if p.seed is not None else None for p in rows]
        tokens = []
        for step in range(steps):
            step_logits = torch.randn(len(rows), vocab)
            step_logits[len(others_before)] = logits[step]
            batch = SamplingBatch.build(rows, [[]] * len(rows), [[]] * len(rows), gens, CPU, vocab)
            tokens.append(sampler(step_logits, batch).sampled_token_ids[len(others_before)].item())
        return tokens

    alone = run([], [])
    assert run([SamplingParams(), SamplingParams(seed=7)], [SamplingParams(temperature=0)]) == alone
    assert run([SamplingParams(temperature=0)] * 3, [SamplingParams(seed=1234, min_p=0.1)] * 2) == alone
    assert run([], [SamplingParams()] * 9) == alone


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for token in set(prompt) | set(output):
            x = out[row, token].item()
            out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(output):
            out[row, token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_match_reference():
    torch.manual_seed(0)
    vocab = 40
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams()]
    prompts = [torch.randint(vocab, (n,)).tolist() for n in (5, 12, 0, 7, 3)]
    outputs = [torch.randint(vocab, (n,)).tolist() for n in (9, 20, 15, 0, 4)]
    logits = torch.randn(len(params), vocab) * 3
    batch = build(params, prompts, outputs, vocab_size=vocab)
    torch.testing.assert_close(apply_penalties(logits, batch),
                               reference_penalties(logits, params, prompts, outputs))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    plain = build([SamplingParams(temperature=0)], vocab_size=4)
    penalized = build([SamplingParams(temperature=0, repetition_penalty=1.5)], [[0]], vocab_size=4)
    assert sampler(logits, plain).sampled_token_ids.item() == 0
    assert sampler(logits, penalized).sampled_token_ids.item() == 1


def test_min_tokens_bans_stop_tokens():
    eos, stop = 3, 5
    logits = torch.zeros(4, 8)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    logits[:, 1] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop]).with_eos(eos)] * 3 + \
             [SamplingParams(min_tokens=4, stop_token_ids=[stop]).with_eos(eos)]
    outputs = [[0], [0, 0], [], [0, 0, 0]]
    tokens = sampler(logits, build(params, outputs=outputs, vocab_size=8)).sampled_token_ids.tolist()
    assert tokens[0] == 1 and tokens[2] == 1  # below min_tokens: neither eos nor the stop id
    assert tokens[1] == eos  # reached min_tokens
    assert tokens[3] not in (eos, stop)
    # as vLLM: ignore_eos lets EOS through only once min_tokens are out
    ignoring = [SamplingParams(temperature=0, min_tokens=2, ignore_eos=True).with_eos(eos)] * 2
    tokens = sampler(logits[:2], build(ignoring, outputs=[[0], [0, 0]], vocab_size=8))
    assert tokens.sampled_token_ids.tolist() == [stop, eos]


def test_logprobs_from_raw_logits():
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(3, vocab)
    params = [SamplingParams(temperature=0.3, repetition_penalty=1.8, logprobs=4),
              SamplingParams(temperature=0, logprobs=1), SamplingParams()]
    out = sampler(logits, build(params, [[0, 1, 2]] * 3, [[3]] * 3, vocab_size=vocab))
    raw = logits.log_softmax(-1)
    assert out.logprob_token_ids.shape == (3, 5) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        assert out.sampled_ranks[row].item() == 1 + int((raw[row] > raw[row, token]).sum())


def test_logprobs_zero_and_gather_caps_k():
    logits = torch.randn(2, 6)
    out = sampler(logits, build([SamplingParams(temperature=0, logprobs=0)] * 2, vocab_size=6))
    assert out.logprob_token_ids.shape == (2, 1)
    assert out.sampled_ranks.tolist() == [1, 1]
    ids, values, ranks = gather_logprobs(logits.log_softmax(-1), 20, torch.tensor([0, 5]))
    assert ids.shape == values.shape == (2, 7)
    assert ids[:, 0].tolist() == [0, 5]
    assert torch.equal(ids[:, 1:], logits.argsort(-1, descending=True))
    expected = [1 + int((logits[r] > logits[r, t]).sum()) for r, t in ((0, 0), (1, 5))]
    assert ranks.tolist() == expected


def test_exponential_race_matches_probabilities_with_masked_vocab():
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.full((vocab,), -math.inf)
    logits[[10, 500, 999]] = torch.tensor([0.5, 0.3, 0.2]).log()
    num = 10000
    tokens = sampler(logits.expand(num, -1), SamplingBatch.build(
        [SamplingParams()] * num, [[]] * num, [[]] * num, [None] * num, CPU, vocab)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).float() / num
    assert set(tokens.unique().tolist()) == {10, 500, 999}
    torch.testing.assert_close(counts[[10, 500, 999]], torch.tensor([0.5, 0.3, 0.2]), atol=0.02, rtol=0)
