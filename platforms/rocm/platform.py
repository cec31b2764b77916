"""The ROCm platform: AMD GPUs through torch's HIP build, which answers the torch.cuda API.

Where AMD differs from NVIDIA: the architecture is a gfx name rather than a compute capability,
and fp8 on MI300 (gfx942) is the "fnuz" variant (float8_e4m3fnuz: no negative zero, exponent
bias 8), while gfx950 (MI350) and RDNA4 (gfx12) use the OCP float8_e4m3fn that NVIDIA uses.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.platforms.cuda.platform import GiB, CudaPlatform, GpuDevice, visible_devices
from runtime.plugins.interfaces import BackendCandidate, EagerRunner, GraphRunner, ModelInfo

FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


def detect_rocm() -> tuple[list[GpuDevice], str]:
    """The visible AMD devices, or none and why not."""
    if not torch.version.hip:
        return [], "torch is built without ROCm (HIP); install torch's ROCm wheel with runtime[rocm]"
    if not torch.cuda.is_available():
        return [], (f"no ROCm device visible (torch built for HIP {torch.version.hip}; check the "
                    "amdgpu driver and HIP_VISIBLE_DEVICES)")
    devices = visible_devices()
    if not devices:
        return [], "torch reports no HIP device"
    return devices, ""


def gfx_arch(device: GpuDevice) -> str:
    """"gfx942" from gcnArchName "gfx942:sramecc+:xnack-"."""
    return device.arch.split(":", 1)[0]


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"  # HIP devices are torch "cuda" devices

    @property
    def arch(self) -> str:
        return gfx_arch(self.devices[0])

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def fp8_dtype(self) -> torch.dtype:
        """The fp8 format this GPU's matrix cores compute (for the quantization kernels)."""
        return torch.float8_e4m3fnuz if self.arch in FNUZ_ARCHS else torch.float8_e4m3fn

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        from runtime.platforms.rocm.attention import attention_candidates
        return attention_candidates(model)

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        """HIP graphs through torch's CUDA graph API; eager with `--enforce-eager`."""
        from runtime.platforms.cuda.graph_runner import CudaGraphRunner
        return EagerRunner() if enforce_eager else CudaGraphRunner("hip graphs")

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        """None: every method runs its reference kernel (CUDA's fp8 kernel assumes NVIDIA's
        fp8 format and compute capabilities)."""
        return None

    def describe(self) -> dict[str, Any]:
        first = self.devices[0]
        return {
            "devices": f"{len(self.devices)} x {first.name}",
            "arch": self.arch,
            "memory per device": f"{first.total_memory / GiB:.1f} GiB",
            "torch HIP": torch.version.hip,
            "fp8 format": str(self.fp8_dtype()).removeprefix("torch."),
            "default dtype": str(self.default_dtype()).removeprefix("torch."),
            "memory utilization": self.memory_utilization,
        }
