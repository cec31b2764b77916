"""Logit adjustments that apply to greedy and random rows alike: the allowed tokens (grammar,
allowed_token_ids), bans (min_tokens, bad_words), logit_bias and penalties."""
from __future__ import annotations

import torch

from runtime.sampling.batch import SamplingBatch
from runtime.structured_output.bitmask import apply_token_bitmask_


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch,
                    in_place: bool = False) -> torch.Tensor:
    """Keep the allowed tokens, ban stop tokens below min_tokens and bad words, add logit_bias,
    then apply repetition, presence and frequency penalties.

    Returns the adjusted logits. `in_place`: the caller gives `logits` up (its own copy), so
    the masks and bias may change it; otherwise `logits` is left untouched.
    """
    if not in_place and (batch.token_bitmask is not None or batch.banned_rows is not None
                         or batch.bias is not None):
        logits = logits.clone()
    if batch.token_bitmask is not None:
        apply_token_bitmask_(logits, batch.token_bitmask, batch.bitmask_rows)
    if batch.banned_rows is not None:
        logits.index_put_((batch.banned_rows, batch.banned_ids), logits.new_tensor(float("-inf")))
    if batch.bias is not None:
        logits += batch.bias
    if batch.repetition_penalty is not None:
        # Hugging Face semantics over prompt and output tokens: shrink positive logits, grow
        # negative ones, so a seen token always becomes less likely.
        penalty = batch.repetition_penalty[:, None]
        seen = batch.prompt_mask | (batch.output_counts > 0)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        # OpenAI semantics over output tokens only.
        counts = batch.output_counts
        logits = (logits - batch.frequency_penalty[:, None] * counts
                  - batch.presence_penalty[:, None] * (counts > 0))
    return logits
