"""The XPU platform: Intel GPUs (Data Center GPU Max, Arc) through torch.xpu.

torch.xpu mirrors torch.cuda's device and memory API, so the platform is the CUDA one with
another device type, its own detection and no compute capability.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from runtime.platforms.common import module_available
from runtime.platforms.cuda.platform import GiB, CudaPlatform, GpuDevice
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                        EagerRunner, GraphRunner, ModelInfo)

ONECCL = "oneccl_bindings_for_pytorch"


def detect_xpu() -> tuple[list[GpuDevice], str]:
    """The visible Intel GPUs, or none and why not."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return [], f"torch {torch.__version__} has no torch.xpu"
    if not xpu.is_available():
        return [], ("no XPU device visible (needs torch's XPU wheel and Intel's GPU driver; "
                    "check ZE_AFFINITY_MASK)")
    devices = []
    for i in range(xpu.device_count()):
        p = xpu.get_device_properties(i)
        devices.append(GpuDevice(i, p.name, (0, 0), p.total_memory))
    return devices, ""


def collective_backend() -> str:
    """torch's native "xccl" where available, else oneCCL's "ccl" (registered on import)."""
    if getattr(dist, "is_xccl_available", lambda: False)():
        return "xccl"
    if module_available(ONECCL):
        importlib.import_module(ONECCL)
        return "ccl"
    raise RuntimeError(f"no XPU collectives: torch has no xccl backend and {ONECCL} "
                       "is not installed")


class XpuPlatform(CudaPlatform):
    name = "xpu"
    device_type = "xpu"

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        from runtime.platforms.xpu.attention import attention_candidates
        return attention_candidates(model)

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        return EagerRunner()

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        from runtime.platforms.distributed import TorchDistCommunicator
        return TorchDistCommunicator(spec, collective_backend(),
                                     torch.device("xpu", torch.xpu.current_device()))

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        return None  # every method runs its reference kernel

    def describe(self) -> dict[str, Any]:
        first = self.devices[0]
        return {
            "devices": f"{len(self.devices)} x {first.name}",
            "memory per device": f"{first.total_memory / GiB:.1f} GiB",
            "default dtype": str(self.default_dtype()).removeprefix("torch."),
            "memory utilization": self.memory_utilization,
        }
