"""The built-in CPU platform plugin.

It drives torch's cpu device: detection always succeeds, at priority 0 so that any accelerator
outranks it. Its other hooks answer for every platform whose `device_type` is "cpu" (a third-party
platform running on the host gets the portable attention, eager runner and gloo) and return None
for the rest.
"""
from __future__ import annotations

import os

from runtime.attention_backends.base import AttentionBackend
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec, EagerRunner,
                                GraphRunner, ModelInfo, Platform, PlatformCandidate)
from runtime.plugins.selection import choose_attention_backend
from runtime.platforms.common import offer_backend
from runtime.platforms.cpu.communicator import GlooCommunicator
from runtime.platforms.cpu.compile_runner import CompileRunner
from runtime.platforms.cpu.platform import CpuPlatform

CPU_PRIORITY = 0
PLUGIN = "cpu"
ATTENTION_BACKENDS = ("cpu_paged", "torch_paged")
COMPILE_ENV = "RUNTIME_CPU_COMPILE"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    """The host CPU is always usable."""
    return [PlatformCandidate("cpu", CpuPlatform(), CPU_PRIORITY)]


def kernel_build_error(platform: Platform) -> str | None:
    """Why the CPU kernels are not loaded for this host (building them the first time), or
    None when they are."""
    from runtime.platforms.cpu import kernels
    info = getattr(platform, "info", None)
    return kernels.load(info.model_name if info else platform.name)


def attention_candidates(platform: Platform, model: ModelInfo) -> list[BackendCandidate]:
    """The native-kernel backend first (when this host can build its kernels), then the
    portable one, which runs everywhere."""
    from runtime.attention_backends.cpu_paged import CpuPagedAttention  # imported when first needed
    from runtime.attention_backends.torch_paged import TorchPagedAttention
    native = []
    if CpuPagedAttention.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                  model.sliding_window, platform.device_type)[0]:
        failed = kernel_build_error(platform)
        native = [f"the CPU kernels did not build: {failed}"] if failed else []
    return [
        offer_backend("cpu_paged", CpuPagedAttention, 10, model, "cpu", PLUGIN, native),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "cpu", PLUGIN, []),
    ]


@hookimpl
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate] | None:
    if platform.device_type != "cpu":
        return None
    return attention_candidates(platform, model)


@hookimpl
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    """`cpu_paged` (native decode kernel) where it builds and fits the model, else the portable
    `torch_paged`; `requested` must name one of the two."""
    if platform.device_type != "cpu":
        return None
    if requested not in (None, *ATTENTION_BACKENDS) and platform.name != CpuPlatform.name:
        return None  # another host platform may know this backend
    return choose_attention_backend(attention_candidates(platform, model), requested, "cpu")


@hookimpl
def runtime_custom_op(platform: Platform, name: str):
    """Fused rms_norm, add_rms_norm, silu_and_mul and rotary_embedding from the CPU kernels,
    when they built, and dense layers through oneDNN for decode-sized inputs."""
    if platform.device_type != "cpu":
        return None
    from runtime.platforms.cpu import ops
    if name == "linear":
        return ops.linear  # torch's own oneDNN, no build needed
    if name not in ops.OPS:
        return None
    return ops.OPS[name] if kernel_build_error(platform) is None else None


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
    from runtime.quantization.cpu import cpu_quantization_kernel
    return cpu_quantization_kernel(method, params)
