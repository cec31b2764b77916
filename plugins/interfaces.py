"""The objects a plugin hands to the engine through the hooks.

These are the only types a platform plugin needs from us besides the hook markers; they import
nothing of the engine, so a third-party wheel can depend on them without pulling engine internals.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class Platform(ABC):
    """One device family (cpu, cuda, rocm, xpu, tpu, or a third party's).

    The engine asks a platform everything that depends on the hardware: which torch device to put
    tensors on, which dtype is native, how much memory the KV cache may take.
    """

    name: str = ""
    device_type: str = ""

    @abstractmethod
    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device for the worker of this local rank."""

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The dtype used when the user does not pass `--dtype`."""

    @abstractmethod
    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        """Bytes the KV cache may take on one device.

        `requested` is the user's `--kv-cache-memory` (None for the platform's default);
        `model_bytes` is what the loaded weights already hold there.
        """

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def describe(self) -> dict[str, Any]:
        """Facts shown by `runtime plugins` (device name, memory, ISA features …)."""
        return {}

    def set_num_threads(self, num_threads: int | None) -> None:
        """Apply the user's thread count, where the device has host threads to set."""


@dataclass
class PlatformCandidate:
    """A plugin's answer to platform detection.

    `platform` is None when the device is not usable here; `reason` then says why (shown in the
    error that lists every candidate, and by `runtime plugins`). Higher `priority` wins.
    """

    name: str
    platform: Platform | None
    priority: int = 0
    reason: str = ""
    plugin: str = ""


class Communicator(ABC):
    """Collectives for one process group (tensor, pipeline or data parallel)."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group; returns the reduced tensor (may be the same object)."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point send to group rank `dst`."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` from group rank `src`."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise NotImplementedError


@dataclass
class CommunicatorSpec:
    """What the engine asks a communicator for: a group of global ranks and how to reach them."""

    ranks: list[int]
    rank: int
    init_method: str
    backend_hint: str = ""


class GraphRunner(ABC):
    """How the forward pass runs: eagerly, through torch.compile, CUDA/HIP graphs or XLA.

    `capture` is called once after the model and KV cache exist; `run` is called every step with
    the step's keyword arguments and returns the model's hidden states.
    """

    name: str = "eager"

    @abstractmethod
    def capture(self, forward: Callable[..., torch.Tensor], example: dict[str, Any]) -> None:
        """Prepare to run `forward` (warm up, compile or record graphs)."""

    @abstractmethod
    def run(self, **inputs: Any) -> torch.Tensor:
        """Run one forward pass."""


class EagerRunner(GraphRunner):
    """Runs the forward pass as plain Python; every platform can fall back to it."""

    name = "eager"

    def capture(self, forward: Callable[..., torch.Tensor], example: dict[str, Any]) -> None:
        self._forward = forward

    def run(self, **inputs: Any) -> torch.Tensor:
        return self._forward(**inputs)


@dataclass
class ModelInfo:
    """What a hook learns about the model being served (a plain view of the engine's config)."""

    architecture: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
