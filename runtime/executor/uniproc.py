"""One worker, in the engine's own process."""
from __future__ import annotations

from typing import Any

from runtime.executor.base import Executor
from runtime.core.messages import StepInput, StepOutput
from runtime.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def state_bytes_per_slot(self) -> int:
        return self.worker.state_bytes_per_slot()

    def init_kv_cache(self, num_blocks: int, num_checkpoints: int = 0) -> None:
        self.worker.init_kv_cache(num_blocks, num_checkpoints)

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]
