"""Verification of proposed tokens by rejection sampling, which leaves the target model's
distribution unchanged.

Each request verifies k proposed tokens d_1..d_k on k + 1 rows of target logits: row j holds
the target's distribution p_j for the token at d_j's place, row k the one after d_k.

- Greedy requests accept d_j while it is the target's argmax; the first mismatch is replaced by
  the argmax, and if all match the argmax of row k follows (the tokens of plain greedy).
- Random requests accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the
  distribution d_j was drawn from (one-hot for n-gram proposals: accept with p_j(d_j)). The
  first rejected d_j is replaced by a draw from norm(max(0, p_j - q_j)); if all are accepted a
  bonus token is drawn from p_k. Each emitted token is then distributed as the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling.batch import SamplingBatch
from runtime.sampling.sampler import argmax, exponential_race, random_probs


@dataclass
class Verification:
    """One request's rows: `offset` .. `offset + len(draft_token_ids)` of the logits."""

    offset: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, V] the q_j the drafts were drawn from; None: one-hot
    greedy: bool
    generator: torch.Generator | None


def rejection_sample(logits: torch.Tensor, batch: SamplingBatch,
                     requests: list[Verification]) -> list[list[int]]:
    """The tokens each request emits (its accepted drafts, then one token of the target's):
    1 to k + 1 of them. `logits` [R, V] are after penalties; `batch` describes its R rows."""
    best = argmax(logits).tolist() if any(v.greedy for v in requests) else None
    probs = None if batch.all_greedy else random_probs(logits, batch)
    accept = _accept_random(probs, requests) if probs is not None else {}

    emitted: list[list[int]] = []
    final_rows, residuals, generators = [], [], {}
    for i, v in enumerate(requests):
        k = len(v.draft_token_ids)
        if v.greedy:
            a = 0
            while a < k and v.draft_token_ids[a] == best[v.offset + a]:
                a += 1
            emitted.append(v.draft_token_ids[:a] + [best[v.offset + a]])
            continue
        a = accept[i]
        emitted.append(v.draft_token_ids[:a])
        if v.generator is not None:
            generators[len(final_rows)] = v.generator
        final_rows.append((i, v.offset + a))
        residuals.append(None if a == k else (a, v.draft_token_ids[a]))
    if final_rows:
        dist = probs[[row for _, row in final_rows]].clone()
        for j, ((i, _), residual) in enumerate(zip(final_rows, residuals)):
            if residual is None:
                continue
            a, token = residual
            q = requests[i].draft_probs
            if q is None:
                dist[j, token] = 0.0
            else:
                dist[j] = (dist[j] - q[a]).clamp_(min=0.0)
            if not dist[j].sum() > 0:  # p <= q everywhere: only rounding can reject here
                dist[j] = probs[final_rows[j][1]]
        tokens = exponential_race(dist, generators).tolist()
        for (i, _), token in zip(final_rows, tokens):
            emitted[i].append(token)
    return emitted


def _accept_random(probs: torch.Tensor, requests: list[Verification]) -> dict[int, int]:
    """For each random request (by index), how many of its drafts are accepted."""
    rows, tokens, draws = [], [], []
    for v in requests:
        if v.greedy or not v.draft_token_ids:
            continue
        k = len(v.draft_token_ids)
        rows += range(v.offset, v.offset + k)
        tokens += v.draft_token_ids
        draws.append(torch.rand(k, generator=v.generator, device=probs.device))
    if not rows:
        return {i: 0 for i, v in enumerate(requests) if not v.greedy}
    p = probs[rows, tokens].tolist()
    u = torch.cat(draws).tolist()
    accepted, pos = {}, 0
    for i, v in enumerate(requests):
        k = len(v.draft_token_ids)
        if v.greedy or k == 0:
            accepted[i] = 0
            continue
        q = [1.0] * k if v.draft_probs is None else \
            v.draft_probs[torch.arange(k), v.draft_token_ids].tolist()
        a = 0
        while a < k and u[pos + a] * q[a] < p[pos + a]:
            a += 1
        accepted[i] = a
        pos += k
    return accepted
