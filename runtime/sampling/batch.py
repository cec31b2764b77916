"""The per-step sampling inputs: one row per request, built on the host, moved to the device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.sampling_params import SamplingParams
from runtime.structured_output.bitmask import pack_token_ids


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
    # (row, token) pairs to ban: stop tokens of rows still below min_tokens, and bad words'
    # last tokens where the output ends with the word's other tokens
    banned_rows: torch.Tensor | None  # [N] int64
    banned_ids: torch.Tensor | None  # [N] int64
    bias: torch.Tensor | None  # [B, V] float32: logit_bias (0 where none)
    # the allowed tokens (grammar and allowed_token_ids) of the rows that restrict them, packed:
    # int32 [R, ceil(V / 32)], bit t % 32 of word t // 32 set when token t is allowed
    token_bitmask: torch.Tensor | None
    bitmask_rows: torch.Tensor | None  # [R] int64: the row each mask row goes to; None: all
    generators: dict[int, torch.Generator]  # row -> its own generator, for seeded random rows
    max_num_logprobs: int | None  # the most logprobs a row asks for; None: no row asks

    @property
    def adjusts_logits(self) -> bool:
        """Whether some row's logits are masked, banned, biased or penalized before sampling."""
        return any(x is not None for x in (
            self.token_bitmask, self.banned_rows, self.bias, self.repetition_penalty,
            self.presence_penalty, self.frequency_penalty))

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              device: torch.device, vocab_size: int,
              grammar_bitmasks: list[np.ndarray | None] | None = None) -> SamplingBatch:
        """Gather the rows' parameters into tensors on `device`.

        `generators[i]` is row i's own generator (from its seed) or None; it must live on
        `device`. `vocab_size` is the width of the logits the sampler will receive.
        `grammar_bitmasks[i]` is row i's allowed tokens under its grammar (int32 [ceil(V /
        32)], bit t set: token t allowed) or None.
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
                  if len(out) < p.min_tokens for t in sorted(_min_tokens_bans(p))
                  if t < vocab_size]
        banned += [(i, t) for i, (p, out) in enumerate(zip(params, output_token_ids))
                   for t in _bad_word_bans(p, out) if t < vocab_size]
        banned_rows = banned_ids = None
        if banned:
            rows, ids = zip(*banned)
            banned_rows = torch.tensor(rows, dtype=torch.int64).to(device)
            banned_ids = torch.tensor(ids, dtype=torch.int64).to(device)
        bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros(len(params), vocab_size, dtype=torch.float32)
            for i, p in enumerate(params):
                for t, value in (p.logit_bias or {}).items():
                    if t < vocab_size:
                        bias[i, t] = value
            bias = bias.to(device)

        token_bitmask, bitmask_rows = _token_bitmask(params, grammar_bitmasks, vocab_size, device)
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
            banned_rows=banned_rows,
            banned_ids=banned_ids,
            bias=bias,
            token_bitmask=token_bitmask,
            bitmask_rows=bitmask_rows,
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


def _min_tokens_bans(params: SamplingParams) -> frozenset[int]:
    """The tokens banned below min_tokens: the stop tokens and, as vLLM, the model's EOS even
    under ignore_eos (which only lets EOS through once min_tokens are out)."""
    eos = params.eos_token_id
    return params.all_stop_token_ids | ({eos} if eos is not None else set())


def _bad_word_bans(params: SamplingParams, output: list[int]) -> list[int]:
    """The tokens that would complete one of the row's bad words after `output`."""
    return [word[-1] for word in params._bad_words_token_ids or ()
            if len(word) == 1 or output[-(len(word) - 1):] == word[:-1]]


def _token_bitmask(params: list[SamplingParams], grammar_bitmasks: list[np.ndarray | None] | None,
                   vocab_size: int, device: torch.device
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The packed masks of the rows with a grammar or allowed_token_ids (both: their AND),
    and those rows (None when every row has one)."""
    width = -(-vocab_size // 32)
    rows, masks = [], []
    for i, p in enumerate(params):
        grammar = None if grammar_bitmasks is None else grammar_bitmasks[i]
        if grammar is None and p.allowed_token_ids is None:
            continue
        mask = None if grammar is None else grammar[:width]
        if p.allowed_token_ids is not None:
            allowed = pack_token_ids(p.allowed_token_ids, vocab_size)
            mask = allowed if mask is None else mask & allowed
        rows.append(i)
        masks.append(mask)
    if not rows:
        return None, None
    bitmask = torch.from_numpy(np.stack(masks)).to(device)
    if len(rows) == len(params):
        return bitmask, None
    return bitmask, torch.tensor(rows, dtype=torch.int64).to(device)
