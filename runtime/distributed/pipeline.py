"""One pipeline stage's view of the pipeline: its layers, and the hidden states it receives from
the stage before and sends to the stage after (the worker cuts steps into micro-batches,
`runtime.worker.micro_batches`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.distributed.layout import layer_range

# What one stage hands the next: the hidden states and the residual, [T, H] each.
Intermediate = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PipelineStage:
    """`group` links this rank with its peers (same tp_rank) in the other stages; None when
    there is one stage."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a runtime.plugins.interfaces.Communicator

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        return layer_range(num_layers, self.rank, self.size)

    def owns(self, name: str, num_layers: int) -> bool:
        """Whether the checkpoint tensor `name` (HF naming) belongs to this stage."""
        if self.size == 1:
            return True
        if ".layers." in name:
            index = int(name.split(".layers.", 1)[1].split(".", 1)[0])
            start, end = self.layers(num_layers)
            return start <= index < end
        if "embed_tokens" in name:
            return self.is_first
        return self.is_last  # the final norm and the LM head

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand this stage's output (hidden states and residual, [T, H] each) to the next."""
        self.group.send(torch.stack([hidden, residual]), dst=self.rank + 1)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> Intermediate:
        """The previous stage's output for the `num_tokens` tokens of this step."""
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        self.group.recv(buf, src=self.rank - 1)
        return buf[0], buf[1]
