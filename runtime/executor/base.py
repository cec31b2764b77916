"""The executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Any

from runtime.core.messages import StepInput, StepOutput


class WorkerError(RuntimeError):
    """A worker died or failed; the executor has stopped the others and serves no more steps."""


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every worker; returns the output of the rank that samples."""

    def check_health(self) -> None:
        """Raise WorkerError if a worker is gone (called while the engine is idle)."""

    def shutdown(self) -> None:
        """Stop the workers and release their devices."""


def worker_reply(method: str, result: Any, keeps_output: bool) -> Any:
    """What a worker process sends back for a call: all of it from the rank that samples (and
    for every call but `execute`); from the other ranks, only the part of a step's output that
    the engine merges over every rank (the KV connector's report)."""
    if keeps_output or method != "execute":
        return result
    return result.kv_connector_output


def step_output(replies: list[Any], output_rank: int) -> StepOutput:
    """The step's output: the sampling rank's, with every rank's KV connector report merged."""
    out = replies[output_rank]
    for rank, reply in enumerate(replies):
        if rank != output_rank and reply is not None:
            mine = out.kv_connector_output
            out.kv_connector_output = reply if mine is None else mine.merge(reply)
    return out
