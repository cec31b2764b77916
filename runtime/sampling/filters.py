"""Truncation of the distribution for random rows: top-k, top-p and min-p."""
from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    `top_k` holds the vocab size on rows without a top-k filter, `top_p` 1.0 on rows without
    a nucleus; ties at the k-th value are all kept. Returns a new tensor.
    """
    if top_p is None:
        return logits if top_k is None else _top_k_only(logits, top_k, max_top_k)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Ascending order: drop the low tail whose total mass is at most 1 - p, never the top token.
    tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = tail_mass <= 1 - top_p[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # torch.topk up to the largest k is much cheaper than sorting the whole vocabulary.
    top = logits.topk(max_top_k, dim=-1).values
    kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth.masked_fill_((top_k >= logits.shape[-1])[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose probability is below min_p times the top probability.

    Compared in log space (p_i / p_max = exp(l_i - l_max)), so no softmax is needed; rows with
    min_p = 0 get a threshold of -inf and are unchanged. Returns a new tensor.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))
