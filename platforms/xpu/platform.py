"""The XPU platform: Intel GPUs (Data Center GPU Max, Arc) through torch.xpu.

torch.xpu mirrors torch.cuda's device and memory API, so the platform is the CUDA one with
another device type, its own detection and no compute capability.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.platforms.cuda.platform import GiB, CudaPlatform, GpuDevice


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


class XpuPlatform(CudaPlatform):
    name = "xpu"
    device_type = "xpu"

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def describe(self) -> dict[str, Any]:
        first = self.devices[0]
        return {
            "devices": f"{len(self.devices)} x {first.name}",
            "memory per device": f"{first.total_memory / GiB:.1f} GiB",
            "default dtype": str(self.default_dtype()).removeprefix("torch."),
            "memory utilization": self.memory_utilization,
        }
