"""The worker's side of prompts given as embeddings (runtime.engine.prompt_embeds): the rows
of a step's prompt positions are the request's own embeddings; the tokens it generated after
them are embedded from their ids, as any token."""
from __future__ import annotations

import torch
from torch import nn

from runtime.batch import Batch
from runtime.core.messages import ScheduledRequest


def merge_prompt_embeds(model: nn.Module, reqs: list[ScheduledRequest], batch: Batch,
                        embeds: torch.Tensor | None) -> torch.Tensor | None:
    """`embeds` (the step's input embeddings so far; None: the token ids' own) with the rows
    of the prompt positions of embeddings prompts put in; `embeds` itself when the step
    reaches no such position."""
    spans = []  # (request, first batch row, first prompt position, end position)
    for i, r in enumerate(reqs):
        if r.prompt_embeds is not None and r.start_pos < r.num_prompt_tokens:
            end = min(r.start_pos + len(r.token_ids), r.num_prompt_tokens)
            spans.append((r, int(batch.query_start_loc[i]), r.start_pos, end))
    if not spans:
        return embeds
    if embeds is None:
        embeds = model.embed_input_ids(batch.input_ids)
    for r, row, start, end in spans:
        rows = r.prompt_embeds[start:end].to(embeds.device, embeds.dtype)
        embeds[row:row + end - start] = model.scale_inputs_embeds(rows)
    return embeds
