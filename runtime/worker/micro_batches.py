"""A pipeline-parallel step cut into micro-batches, so the stages work on different parts of it
at the same time, and the parts' outputs merged back."""
from __future__ import annotations

from dataclasses import fields

from runtime.core.messages import ScheduledRequest, StepOutput


def micro_batches(requests: list[ScheduledRequest], n: int) -> list[list[ScheduledRequest]]:
    """Split a step's requests into up to `n` consecutive runs with about equal token counts,
    so that stage k can work on one while stage k+1 works on the one before. Every rank splits
    the same step the same way."""
    total = sum(len(r.token_ids) for r in requests)
    parts: list[list[ScheduledRequest]] = [[]]
    done = 0
    for r in requests:
        # a new part once this request would sit mostly past the current part's share
        past_share = done + len(r.token_ids) / 2 > total * len(parts) / n
        if parts[-1] and len(parts) < n and past_share:
            parts.append([])
        parts[-1].append(r)
        done += len(r.token_ids)
    return parts


def merge_outputs(outputs: list[StepOutput]) -> StepOutput:
    merged = StepOutput()
    for out in outputs:
        for f in fields(StepOutput):
            if isinstance(getattr(merged, f.name), dict):  # per request: each part has its own
                getattr(merged, f.name).update(getattr(out, f.name))
    return merged
