"""The per-step sampling inputs: one row per request, built on the host, moved to the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Everything the sampler needs for one step; a field is None when no row uses it.

    Rows whose filter or penalty is off hold the neutral value (top_k = vocab size, top_p = 1,
    min_p = 0, repetition 1, presence/frequency 0), so batched stages leave them unchanged.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None  # [B] bool; only for a mix of greedy and random rows
    temperature: torch.Tensor | None  # [B] float32 (1.0 on greedy rows); None when all greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where off
    max_top_k: int  # the largest top_k in use (0 when none)
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32, set together with frequency_penalty
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt (repetition only)
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    min_tokens_rows: torch.Tensor | None  # [N] int64 } (row, token) pairs to ban: stop tokens
    min_tokens_ids: torch.Tensor | None  # [N] int64 } of rows still below min_tokens
    generators: dict[int, torch.Generator]  # row -> its own generator, for seeded random rows
    max_num_logprobs: int | None  # the most logprobs a row asks for; None: no row asks

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              device: torch.device, vocab_size: int) -> SamplingBatch:
        """Gather the rows' parameters into tensors on `device`.

        `generators[i]` is row i's own generator (from its seed) or None; it must live on
        `device`. `vocab_size` is the width of the logits the sampler will receive.
        """
        greedy = [p.greedy for p in params]
        random = [not g for g in greedy]
        all_greedy, all_random = not any(random), not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        def used(values: list[float], neutral: float) -> torch.Tensor | None:
            return floats(values) if any(v != neutral for v in values) else None

        temperature = None
        if not all_greedy:
            temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])

        ks = [p.top_k if r and 0 < p.top_k < vocab_size else vocab_size
              for p, r in zip(params, random)]
        max_top_k = max((k for k in ks if k < vocab_size), default=0)
        top_k = torch.tensor(ks, dtype=torch.int64).to(device) if max_top_k else None
        top_p = used([p.top_p if r else 1.0 for p, r in zip(params, random)], 1.0)
        min_p = used([p.min_p if r else 0.0 for p, r in zip(params, random)], 0.0)

        repetition = used([p.repetition_penalty for p in params], 1.0)
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        additive = any(presence) or any(frequency)
        output_counts = prompt_mask = None
        if repetition is not None or additive:
            output_counts = _token_counts(output_token_ids, vocab_size, device)
        if repetition is not None:
            prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0

        banned = [(i, t) for i, (p, out) in enumerate(zip(params, output_token_ids))
                  if len(out) < p.min_tokens for t in sorted(p.all_stop_token_ids) if t < vocab_size]
        min_tokens_rows = min_tokens_ids = None
        if banned:
            rows, ids = zip(*banned)
            min_tokens_rows = torch.tensor(rows, dtype=torch.int64).to(device)
            min_tokens_ids = torch.tensor(ids, dtype=torch.int64).to(device)

        asks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=len(params),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy=None if all_greedy or all_random else torch.tensor(greedy).to(device),
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=floats(presence) if additive else None,
            frequency_penalty=floats(frequency) if additive else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            min_tokens_rows=min_tokens_rows,
            min_tokens_ids=min_tokens_ids,
            generators={i: g for i, g in enumerate(generators) if g is not None and random[i]},
            max_num_logprobs=max(asks) if asks else None,
        )


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 occurrence counts; ids outside the vocabulary are ignored."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.clamp_(max=vocab_size).to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
