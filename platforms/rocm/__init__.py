"""The built-in ROCm platform plugin (AMD GPUs; `pip install runtime[rocm]` with torch's ROCm wheel).

It reuses the CUDA plugin's machinery where HIP mirrors CUDA — HIP graphs through torch's CUDA
graph API, RCCL through torch's "nccl" backend — and makes its own choices where AMD differs:
attention is our Triton paged kernel (AMD's FlashAttention builds have no paged-KV varlen
kernel) with the portable torch backend as the last resort, and fp8 is "fnuz" on MI300.
The plugin's one hook is detection; the rest are methods of `RocmPlatform`.
"""
from __future__ import annotations

from runtime.platforms.rocm.platform import RocmPlatform, detect_rocm
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate

ROCM_PRIORITY = 100


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_rocm()
    return [PlatformCandidate("rocm", RocmPlatform(devices) if devices else None, ROCM_PRIORITY,
                              reason)]
