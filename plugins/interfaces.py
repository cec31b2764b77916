"""The objects a plugin hands to the engine through the hooks.

These are the only types a platform plugin needs from us besides the hook markers; they import
nothing of the engine, so a third-party wheel can depend on them without pulling engine internals.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch


class Platform(ABC):
    """One device family (cpu, cuda, rocm, xpu, tpu, or a third party's).

    The engine asks a platform everything that depends on the hardware: which torch device to put
    tensors on, which dtype is native, how much memory the KV cache may take, and, through the
    hooks, its own attention backends, graph runner, communicator, quantization kernels and
    custom ops. Those last answers are the methods under "Per-platform answers": the hooks'
    default implementation (`runtime.plugins.platform_answers`) returns what the chosen
    platform's method returns, so one platform's answers never reach another platform, and a
    plugin can still override any of them with a `tryfirst` hook implementation. A platform
    that wants another's answers says so by subclassing it (a CPU-backed device subclasses
    `runtime.platforms.cpu.platform.CpuPlatform` to get the CPU kernels).
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
        `model_bytes` is what the model needs there besides the cache: its loaded weights plus
        the activation peak that `measure_peak_memory` returned.
        """

    def set_device(self, device: torch.device) -> None:
        """Make `device` this process's current device. The worker calls it first, before
        anything touches the device: kernels, graphs, memory queries and collectives that take
        no device argument use the current one (a no-op where there is none to set)."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def describe(self) -> dict[str, Any]:
        """Facts shown by `runtime plugins` (device name, memory, ISA features …)."""
        return {}

    def set_threads(self, num_threads: int | None, host_rank: int, host_ranks: int) -> None:
        """Share out and bind the host's threads for one rank.

        Called once in the process that runs rank `host_rank` of the `host_ranks` ranks on
        this host (the engine's own process for a single rank, else each worker process),
        before its model loads. `num_threads` is the user's `--num-threads` (None: the
        platform decides). The default does nothing (a device with no host threads to set)."""

    def rebalance_threads(self) -> None:
        """Adjust the threads `set_threads` set up to what the host allows now.

        Called by the worker after every step, between steps (no parallel region is running),
        so it must return at once when there is nothing to do: a platform samples the host at
        its own interval. The CPU platform drops the threads of cores that other processes
        took while the rank ran and pins them again once they are free. The default does
        nothing."""

    def set_memory_utilization(self, fraction: float | None) -> None:
        """Apply `--gpu-memory-utilization`: the share of device memory the engine may take in all
        (weights, activations, KV cache). Platforms that size the cache otherwise ignore it."""

    def measure_peak_memory(self, run: Callable[[], Any]) -> int:
        """Device bytes a forward pass of the largest batch takes beyond what is already held.

        The engine calls this once, before `kv_cache_memory_bytes`, with `run` doing that forward
        pass (on a small scratch KV cache). An accelerator runs it and measures its allocator's
        peak; the default runs nothing and returns 0 (the CPU sizes its cache from free RAM).
        """
        return 0

    def empty_cache(self) -> None:
        """Give back the memory the engine has just freed (sleep mode, a weight reload): the
        device allocator's cached blocks, or the host heap's free pages. Default: nothing to
        give back."""

    # Per-platform answers (what the hooks of the same name return by default).

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        """Every attention backend this platform considers for `model`, the unusable ones with
        their reason. The hooks' default implementation picks among them
        (`runtime.plugins.backend_choice.choose_attention_backend`: the usable one of highest
        priority, or the one forced with `--attention-backend`). Default: the portable torch
        backend, which runs wherever torch does."""
        from runtime.attention_backends.torch_paged import TorchPagedAttention
        ok, why = TorchPagedAttention.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                               model.sliding_window, self.device_type)
        return [BackendCandidate("torch_paged", TorchPagedAttention if ok else None, 0, why)]

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        """How the forward pass runs. Default: eagerly."""
        return EagerRunner()

    def communicator(self, spec: CommunicatorSpec) -> Communicator | None:
        """Collectives for one process group. Default: None (the platform runs one rank only;
        the engine refuses a parallel layout with a message naming the platform)."""
        return None

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        """A fast kernel for quantization `method` (see `runtime.quantization`), or None for the
        method's portable reference kernel (the default)."""
        return None

    def custom_op(self, name: str) -> Callable | None:
        """A replacement for the layer op `name` (the names are listed at the
        `runtime_custom_op` hook), or None for the portable op (the default)."""
        return None

    def ray_resource(self) -> str:
        """The Ray resource one rank of this platform takes ("GPU" by default; "CPU", "TPU" or
        a custom resource name otherwise)."""
        return "GPU"


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


@dataclass
class CaptureSpec:
    """What a graph runner learns once the KV cache exists (`GraphRunner.capture`).

    The model reads the step's attention metadata (an `runtime.attention_backends.base.AttentionMetadata`)
    from the engine's forward context; recording a graph means running the forward under metadata
    whose tensors are static buffers, and replaying it means copying the step's metadata into them.
    `forward_context(metadata)` sets that context; `current_metadata()` returns the metadata of the
    step being run (valid inside `GraphRunner.run`).
    """

    forward_context: Callable[[Any], AbstractContextManager]
    current_metadata: Callable[[], Any]
    attention_backend: type  # the chosen AttentionBackend; `graph_capturable` says if it records
    device: torch.device
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class GraphRunner(ABC):
    """How the forward pass runs: eagerly, as CUDA/HIP graphs or through XLA.

    `capture` is called once, after the KV cache is allocated and before the first step; `run`
    every step after it with the step's `input_ids` and `positions`, inside the step's forward
    context, and returns the model's hidden states for exactly those tokens.
    """

    name: str = "eager"

    @abstractmethod
    def capture(self, forward: Callable[..., torch.Tensor], spec: CaptureSpec) -> None:
        """Take `forward` (`forward(input_ids=, positions=)`, the model's) and get ready to run
        it over the allocated KV cache: record device graphs, set up shape buckets, or (eager)
        just keep it."""

    @abstractmethod
    def run(self, **inputs: Any) -> torch.Tensor:
        """Run one forward pass."""


class EagerRunner(GraphRunner):
    """Runs the forward pass as plain Python; every platform can fall back to it."""

    name = "eager"

    def capture(self, forward: Callable[..., torch.Tensor], spec: CaptureSpec) -> None:
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
    block_size: int = 16  # tokens per KV-cache block (some kernels need particular sizes)
    # Device graphs are off (--enforce-eager, or pipeline stages): a backend that cannot be
    # recorded as a graph loses nothing then, so a platform may rank it higher.
    enforce_eager: bool = False
    # A pooling model: prefill-only steps without a KV cache (bidirectional for the BERT
    # family), which only backends with `supports_encoder_attention` run.
    pooling: bool = False
    # Attention sinks (gpt-oss): only backends with `supports_attention_sinks` run the model.
    attention_sinks: bool = False
    # An image's tokens attend to each other both ways (Gemma 3): only backends with
    # `supports_mm_prefix` run the model.
    mm_prefix_lm: bool = False
    # "mha" (K and V per KV head) or "mla" (multi-head latent attention: one cached latent of
    # `head_size` per token, `num_kv_heads` 1), which only backends of that `kind` run
    attention_kind: str = "mha"


@dataclass
class BackendCandidate:
    """One attention backend a plugin can offer for a platform and model, usable or not.

    `backend` is the `runtime.attention_backends.base.AttentionBackend` subclass, or None when it cannot
    run here; `reason` then says why (missing library, compute capability, head size …). Among
    the usable candidates the highest `priority` wins unless the user forces one by name; a
    usable candidate's `reason`, if any, explains its rank and is shown with its verdict.
    """

    name: str
    backend: type | None
    priority: int = 0
    reason: str = ""
    plugin: str = ""
