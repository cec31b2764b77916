"""The executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from runtime.core.messages import StepInput, StepOutput
from runtime.model_loader.source import ModelSource


class WorkerError(RuntimeError):
    """A worker died or failed; the executor has stopped the others and serves no more steps."""


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent state slot on a worker (the most over workers; 0: the model
        has no recurrent layers)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, num_checkpoints: int = 0) -> None:
        """Allocate `num_blocks` KV blocks on every worker (and a hybrid model's
        `num_checkpoints` recurrent-state checkpoint entries in host memory)."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every worker; returns the output of the rank that samples."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call the Worker method `method` with `args` on every rank; their answers, in rank
        order (a rank that raises fails the call)."""

    def sleep(self, level: int) -> None:
        """Free every rank's KV cache (level 1), and its weights too (level 2)."""
        self.collective_rpc("sleep", level)

    def wake_up(self, tags: list[str]) -> None:
        """Bring back on every rank what `tags` ("weights", "kv_cache") name."""
        self.collective_rpc("wake_up", tags)

    def reload_weights(self, source: ModelSource) -> list[str | None]:
        """Load `source`'s weights (same architecture) on every rank; each rank's error, or
        None (a rank that failed serves its old weights again)."""
        return self.collective_rpc("reload_weights", source)

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
