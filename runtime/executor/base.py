"""The executor interface the engine core talks to."""
from __future__ import annotations

from abc import ABC, abstractmethod

from runtime.core.messages import StepInput, StepOutput


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
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every worker; returns the output of the rank that samples."""

    def check_health(self) -> None:
        """Raise WorkerError if a worker is gone (called while the engine is idle)."""

    def shutdown(self) -> None:
        """Stop the workers and release their devices."""
