"""Collectives for CPU workers: torch.distributed over gloo."""
from __future__ import annotations

import torch

from runtime.plugins.interfaces import CommunicatorSpec
from runtime.platforms.distributed import TorchDistCommunicator


class GlooCommunicator(TorchDistCommunicator):
    """One process group over gloo, with tensors on the host (see `TorchDistCommunicator` for
    how ranks and the default group are set up)."""

    def __init__(self, spec: CommunicatorSpec) -> None:
        super().__init__(spec, "gloo", torch.device("cpu"))
