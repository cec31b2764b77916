"""The built-in TPU platform plugin (`pip install runtime[tpu]`: torch_xla on a TPU host).

Attention: torch_xla's ragged paged attention (a Pallas kernel; priority 20) where the installed
torch_xla has it with the combined K/V cache layout, else our shape-static torch backend
(`xla_paged`, 10). Execution: XLA with bucketed shapes (eager with `--enforce-eager`, which
recompiles for every new shape). Collectives: torch_xla's "xla" process-group backend.
Hooks answer only for the platform named "tpu".
"""
from __future__ import annotations

import inspect

from runtime.attention_backends.base import AttentionBackend
from runtime.attention_backends.pallas_ragged import PallasRaggedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.distributed import TorchDistCommunicator
from runtime.platforms.tpu.graph_runner import XlaGraphRunner
from runtime.platforms.tpu.platform import TpuPlatform, detect_tpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec, EagerRunner,
                                GraphRunner, ModelInfo, Platform, PlatformCandidate)
from runtime.plugins.selection import choose_attention_backend

TPU_PRIORITY = 100
PLUGIN = "tpu"
KERNELS = "torch_xla.experimental.custom_kernel"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    count, reason = detect_tpu()
    return [PlatformCandidate("tpu", TpuPlatform(count) if count else None, TPU_PRIORITY, reason)]


def ragged_kernel_problems() -> list[str]:
    """Why torch_xla's ragged paged attention cannot be used here (empty when it can)."""
    if not module_available(KERNELS):
        return [f"{KERNELS} is not available"]
    from torch_xla.experimental import custom_kernel
    kernel = getattr(custom_kernel, "ragged_paged_attention", None)
    if kernel is None:
        return ["this torch_xla has no ragged_paged_attention"]
    if "kv_pages" not in inspect.signature(kernel).parameters:
        return ["this torch_xla's ragged_paged_attention predates the combined K/V layout"]
    return []


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    return [
        offer_backend("pallas_ragged", PallasRaggedAttention, 20, model, "xla", PLUGIN,
                      ragged_kernel_problems()),
        offer_backend("xla_paged", XlaPagedAttention, 10, model, "xla", PLUGIN, []),
    ]


@hookimpl
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate] | None:
    return attention_candidates(model) if platform.name == "tpu" else None


@hookimpl
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    if platform.name != "tpu":
        return None
    return choose_attention_backend(attention_candidates(model), requested, "tpu")


@hookimpl
def runtime_graph_runner(platform: Platform, enforce_eager: bool) -> GraphRunner | None:
    if platform.name != "tpu":
        return None
    return EagerRunner() if enforce_eager else XlaGraphRunner()


@hookimpl
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    if platform.name != "tpu":
        return None
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
    return TorchDistCommunicator(spec, "xla", platform.device())
