"""The rejection sampler on synthetic distributions: it must emit the target's tokens (greedy)
or tokens distributed as the target's (random), whatever the proposals and their distribution."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.sampling.batch import SamplingBatch
from runtime.sampling_params import SamplingParams
from runtime.spec_decode.rejection import Verification, rejection_sample

V = 6


def batch_of(params: list[SamplingParams]) -> SamplingBatch:
    empty = [[] for _ in params]
    return SamplingBatch.build(params, empty, empty, [None] * len(params), torch.device("cpu"), V)


def test_greedy_accepts_the_argmax_prefix_then_emits_the_argmax():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0],
                           [5, 0, 0, 0, 0, 0.]])
    greedy = SamplingParams(temperature=0)
    checks = [Verification(0, [1, 2, 4], None, True, None)]
    assert rejection_sample(logits, batch_of([greedy] * 4), checks) == [[1, 2, 3]]
    checks = [Verification(0, [1, 2, 3], None, True, None)]  # all accepted: the bonus token
    assert rejection_sample(logits, batch_of([greedy] * 4), checks) == [[1, 2, 3, 0]]
    checks = [Verification(0, [0, 2, 3], None, True, None)]
    assert rejection_sample(logits, batch_of([greedy] * 4), checks) == [[1]]


def _first_tokens(p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int) -> list[int]:
    """The first emitted token of `draws` requests verifying one proposal each against p[0]
    (row 1 is the bonus distribution), the proposals drawn from q (one-hot on token 0 if
    None)."""
    generator = torch.Generator().manual_seed(seed)
    logits = p.log().repeat(draws, 1)
    params = [SamplingParams(temperature=1.0)] * (2 * draws)
    checks = []
    for i in range(draws):
        if q is None:
            draft, dist = 0, None
        else:
            draft = int(torch.multinomial(q[0], 1, generator=generator))
            dist = q[:1]
        checks.append(Verification(2 * i, [draft], dist, False, generator))
    emitted = rejection_sample(logits, batch_of(params), checks)
    return [e[0] for e in emitted]


@pytest.mark.parametrize("proposal", ["one-hot", "draft"])
def test_random_emits_the_target_distribution(proposal):
    p = torch.tensor([[0.05, 0.4, 0.25, 0.1, 0.15, 0.05], [0.3, 0.2, 0.1, 0.1, 0.2, 0.1]])
    q = None if proposal == "one-hot" else \
        torch.tensor([[0.5, 0.05, 0.05, 0.3, 0.05, 0.05]]).repeat(2, 1)
    draws = 6000
    tokens = _first_tokens(p, q, draws, seed=0)
    observed = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p[0].double() / p[0].double().sum() * draws
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    # a broken sampler that always kept the proposal would be far off
    wrong = (q[0] if q is not None else torch.eye(V)[0]).double() * draws + 1
    wrong *= (observed + 1).sum() / wrong.sum()
    assert chisquare(observed.numpy() + 1, wrong.numpy()).pvalue < 1e-6


def test_accepted_proposals_are_followed_by_a_draw_from_the_next_row():
    p = torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.03, 0.02], [0.1, 0.1, 0.2, 0.3, 0.2, 0.1]])
    draws = 4000
    generator = torch.Generator().manual_seed(1)
    logits = p.log().repeat(draws, 1)
    checks = [Verification(2 * i, [0], None, False, generator) for i in range(draws)]
    emitted = rejection_sample(logits, batch_of([SamplingParams()] * (2 * draws)), checks)
    bonus = [e[1] for e in emitted if len(e) == 2]
    assert all(e[0] == 0 for e in emitted if len(e) == 2)
    assert abs(len(bonus) / draws - 0.7) < 0.03  # accepted with probability p(0)
    observed = torch.bincount(torch.tensor(bonus), minlength=V).double()
    expected = p[1].double() / p[1].double().sum() * len(bonus)
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_seeded_verification_is_reproducible():
    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)), -1)

    def run() -> list[list[int]]:
        g = torch.Generator().manual_seed(5)
        checks = [Verification(0, [1, 2], None, False, g)]
        return rejection_sample(p.log(), batch_of([SamplingParams()] * 3), checks)

    assert run() == run()


def test_requests_without_proposals_draw_from_their_one_row():
    p = torch.tensor([[0.0, 1.0, 0, 0, 0, 0], [0.0, 0, 1.0, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    q = torch.full((1, V), 1.0 / V)
    checks = [Verification(0, [1], q, False, None), Verification(2, [], q[:0], False, None)]
    assert rejection_sample((p + 1e-9).log(), batch_of([SamplingParams()] * 3), checks) == \
        [[1, 2], [5]]
