"""The one interface through which a feature joins the model runner's step.

LoRA, the speculative proposer and pooling are handed to the `ModelRunner` when it is built
and are called at three points of every step, in the order they were given.
"""
from __future__ import annotations

from typing import Protocol

from runtime.batch import Batch
from runtime.core.messages import ScheduledRequest, StepOutput


class StepHook(Protocol):
    def before_forward(self, reqs: list[ScheduledRequest], batch: Batch) -> None:
        """The step's batch is built, the forward pass is next (LoRA puts the step's adapters
        in their slots)."""

    def after_sampling(self, reqs: list[ScheduledRequest], out: StepOutput) -> None:
        """The step's tokens are in `out` (the proposer adds its proposals for the next step;
        LoRA turns the requests whose adapter failed into errors)."""

    def finish(self, request_ids: list[str]) -> None:
        """These requests were preempted or finished: drop what is kept for them."""
