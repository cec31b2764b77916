"""The built-in CPU platform plugin.

It drives torch's cpu device: detection always succeeds, at priority 0 so that any accelerator
outranks it. Its other hooks answer for every platform whose `device_type` is "cpu" (a third-party
platform running on the host gets the portable attention, eager runner and gloo) and return None
for the rest.
"""
from __future__ import annotations

import os

from attention_backends.base import AttentionBackend
from plugins.hookspecs import hookimpl
from plugins.interfaces import (Communicator, CommunicatorSpec, EagerRunner, GraphRunner,
                                ModelInfo, Platform, PlatformCandidate)
from platforms.cpu.communicator import GlooCommunicator
from platforms.cpu.compile_runner import CompileRunner
from platforms.cpu.platform import CpuPlatform

CPU_PRIORITY = 0
ATTENTION_BACKENDS = ("torch_paged",)
COMPILE_ENV = "RUNTIME_CPU_COMPILE"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    """The host CPU is always usable."""
    return [PlatformCandidate("cpu", CpuPlatform(), CPU_PRIORITY)]


@hookimpl
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    """The portable paged attention in plain torch (the only CPU backend for now)."""
    if platform.device_type != "cpu":
        return None
    if requested not in (None, *ATTENTION_BACKENDS):
        if platform.name != CpuPlatform.name:
            return None  # another host platform may know this backend
        raise ValueError(f"attention backend {requested!r} is not available on the cpu "
                         f"platform; known: {', '.join(ATTENTION_BACKENDS)}")
    from attention_backends.torch_paged import TorchPagedAttention  # imported when first needed
    ok, why = TorchPagedAttention.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                           model.sliding_window, platform.device_type)
    if not ok:
        raise ValueError(f"attention backend {TorchPagedAttention.name!r} cannot run "
                         f"{model.architecture}: {why}")
    return TorchPagedAttention


@hookimpl
def runtime_graph_runner(platform: Platform, enforce_eager: bool) -> GraphRunner | None:
    """Eager by default; torch.compile when RUNTIME_CPU_COMPILE=1 and eager is not enforced."""
    if platform.device_type != "cpu":
        return None
    if os.environ.get(COMPILE_ENV) == "1" and not enforce_eager:
        return CompileRunner()
    return EagerRunner()


@hookimpl
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    """gloo collectives between host processes."""
    if platform.device_type != "cpu":
        return None
    return GlooCommunicator(spec)


@hookimpl
def runtime_quantization_kernel(platform: Platform, method: str, params: dict):
    """torch's native weight-only int8/int4 CPU kernels; None (the reference) for the rest."""
    if platform.device_type != "cpu":
        return None
    from quantization.cpu import cpu_quantization_kernel
    return cpu_quantization_kernel(method, params)
