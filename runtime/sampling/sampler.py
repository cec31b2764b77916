"""The batched sampler: logits in, one token per row out (plus logprobs when asked)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtime.plugins.ops import greedy_argmax as argmax
from runtime.sampling.batch import SamplingBatch
from runtime.sampling.filters import apply_min_p, apply_top_k_top_p
from runtime.sampling.penalties import apply_penalties


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_k]: the sampled token, then the top-k
    logprobs: torch.Tensor | None  # [B, 1 + max_k] float32
    sampled_ranks: torch.Tensor | None  # [B] rank of the sampled token (1 = most likely)


class Sampler:
    """Turns one step's logits into tokens.

    Logprobs come from the raw logits (before penalties and temperature). Then `adjust`: the
    allowed tokens, bans, logit_bias, penalties, and the plugins' logits processors (hook
    `runtime_logits_processors`); greedy rows take the argmax, random rows go through
    temperature, top-k, top-p, min-p and an exponential race. `greedy_argmax` is the
    platform's kernel for each row's first maximum (custom op "greedy_argmax"), else `argmax`.
    """

    def __init__(self, logits_processors: Sequence[Callable] = (),
                 greedy_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.logits_processors = list(logits_processors)
        self.argmax = greedy_argmax or argmax

    def adjust(self, logits: torch.Tensor, batch: SamplingBatch,
               in_place: bool = False) -> torch.Tensor:
        """The logits every row samples from, before temperature and filters; `in_place`: the
        caller gives `logits` up, so they may be masked in place (no copy)."""
        logits = apply_penalties(logits, batch, in_place)
        for processor in self.logits_processors:
            logits = processor(logits, batch)
        return logits

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                 in_place: bool = False) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]. `in_place`: the caller gives `logits`
        up, so they may be masked in place (copying 64 x 49152 float32 logits costs more than
        masking them); otherwise they are not modified."""
        if (batch.all_greedy and batch.max_num_logprobs is None and not batch.adjusts_logits
                and not self.logits_processors):
            # widening is exact, so the argmax of bf16 logits is that of their float32 copy,
            # which costs a [B, V] write and read (3.3 ms at 64 x 49152)
            return SamplerOutput(self.argmax(logits), None, None, None)
        in_place = in_place or logits.dtype != torch.float32  # .float() is then our own copy
        logits = logits.float()
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = self.adjust(logits, batch, in_place)

        if batch.all_greedy:
            sampled = self.argmax(logits)
        elif batch.all_random:
            sampled = self._random_sample(logits, batch)
        else:
            sampled = torch.where(batch.greedy, self.argmax(logits),
                                  self._random_sample(logits, batch))

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, values, ranks = gather_logprobs(raw_logprobs, batch.max_num_logprobs, sampled)
        return SamplerOutput(sampled, ids, values, ranks)

    def _random_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return exponential_race(random_probs(logits, batch), batch.generators, self.argmax)


def random_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows draw from: `logits` (after penalties) through temperature,
    top-k, top-p and min-p, softmaxed. Greedy rows come out at temperature 1, unfiltered."""
    logits = logits / batch.temperature[:, None]
    logits = apply_top_k_top_p(logits, batch.top_k, batch.max_top_k, batch.top_p)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    return logits.softmax(dim=-1)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     row_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """One draw per row of `probs` [B, V] (need not be normalized); overwrites `probs`.

    argmax(p_i / q_i) with q_i ~ Exp(1) draws i with probability p_i / sum(p). A row in
    `generators` draws its q from its own generator, so its tokens do not depend on the batch.
    q = -log(1 - u) with u ~ U[0, 1): torch's CPU `exponential_` is five times slower than
    `uniform_` and a log (77 ms against 15 ms for 64 x 49152 draws on one core).
    """
    u = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    # q > 0 always, so a filtered-out token (p = 0) never gets 0 / 0
    q = u.neg_().log1p_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)
    return (row_argmax or argmax)(probs.div_(q))


def gather_logprobs(logprobs: torch.Tensor, k: int, token_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob and rank of `token_ids` [B] in `logprobs` [B, V], and the top-k per row.

    Returns ids [B, 1 + k] (column 0 is `token_ids`), their logprobs [B, 1 + k] and the ranks
    [B] of `token_ids` (1 = most likely; tied tokens share the worse rank). k is capped at V.
    """
    token_ids = token_ids.long()[:, None]
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs >= chosen).sum(dim=-1)
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return token_ids, chosen, ranks
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks
