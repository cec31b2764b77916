"""The forward pass through torch.compile (inductor), opted into with RUNTIME_CPU_COMPILE=1."""
from __future__ import annotations

from typing import Any, Callable

import torch

from runtime.plugins.interfaces import GraphRunner


class CompileRunner(GraphRunner):
    """Compiles the forward once with dynamic shapes, so changing batch sizes do not recompile."""

    name = "torch.compile"

    def __init__(self, backend: str = "inductor") -> None:
        self.backend = backend  # "eager" / "aot_eager" trace without generating code (debugging)

    def capture(self, forward: Callable[..., torch.Tensor], example: dict[str, Any]) -> None:
        self._compiled = torch.compile(forward, backend=self.backend, dynamic=True)
        self._compiled(**example)  # compile now rather than on the first request

    def run(self, **inputs: Any) -> torch.Tensor:
        return self._compiled(**inputs)
