"""The built-in XPU platform plugin (Intel GPUs; `pip install runtime[xpu]` with torch's XPU wheel).

Attention: IPEX's paged attention when intel-extension-for-pytorch is installed (priority 20),
our Triton paged kernel (10; Triton compiles for Intel GPUs through Intel's XPU backend), the
portable torch backend (0). Execution is eager. Collectives: torch's native "xccl" backend where
torch has it, else oneCCL's "ccl" from oneccl_bindings_for_pytorch. Hooks answer only for the
platform named "xpu".
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from runtime.attention_backends.base import AttentionBackend
from runtime.attention_backends.ipex_paged import IpexPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.distributed import TorchDistCommunicator
from runtime.platforms.xpu.platform import XpuPlatform, detect_xpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec, EagerRunner,
                                GraphRunner, ModelInfo, Platform, PlatformCandidate)
from runtime.plugins.selection import choose_attention_backend

XPU_PRIORITY = 100
PLUGIN = "xpu"
IPEX = "intel_extension_for_pytorch"
ONECCL = "oneccl_bindings_for_pytorch"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_xpu()
    return [PlatformCandidate("xpu", XpuPlatform(devices) if devices else None, XPU_PRIORITY,
                              reason)]


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    ipex = [] if module_available(IPEX) else [f"{IPEX} is not installed"]
    triton = [] if module_available("triton") else ["triton (Intel XPU backend) is not installed"]
    return [
        offer_backend("ipex_paged", IpexPagedAttention, 20, model, "xpu", PLUGIN, ipex),
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "xpu", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "xpu", PLUGIN, []),
    ]


@hookimpl
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate] | None:
    return attention_candidates(model) if platform.name == "xpu" else None


@hookimpl
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    if platform.name != "xpu":
        return None
    return choose_attention_backend(attention_candidates(model), requested, "xpu")


@hookimpl
def runtime_graph_runner(platform: Platform) -> GraphRunner | None:
    return EagerRunner() if platform.name == "xpu" else None


def collective_backend() -> str:
    """torch's native "xccl" where available, else oneCCL's "ccl" (registered on import)."""
    if getattr(dist, "is_xccl_available", lambda: False)():
        return "xccl"
    if module_available(ONECCL):
        importlib.import_module(ONECCL)
        return "ccl"
    raise RuntimeError(f"no XPU collectives: torch has no xccl backend and {ONECCL} "
                       "is not installed")


@hookimpl
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    if platform.name != "xpu":
        return None
    return TorchDistCommunicator(spec, collective_backend(),
                                 torch.device("xpu", torch.xpu.current_device()))
