"""The built-in ROCm platform plugin (AMD GPUs; `pip install runtime[rocm]` with torch's ROCm wheel).

It reuses the CUDA plugin's machinery where HIP mirrors CUDA — HIP graphs through torch's CUDA
graph API, RCCL through torch's "nccl" backend — and makes its own choices where AMD differs:
attention is our Triton paged kernel (AMD's FlashAttention builds have no paged-KV varlen
kernel) with the portable torch backend as the last resort, and fp8 is "fnuz" on MI300.
The plugin's one hook is detection; the rest are methods of `RocmPlatform`.
"""
from __future__ import annotations

from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.rocm.platform import RocmPlatform, detect_rocm
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import BackendCandidate, ModelInfo, PlatformCandidate

ROCM_PRIORITY = 100
PLUGIN = "rocm"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_rocm()
    return [PlatformCandidate("rocm", RocmPlatform(devices) if devices else None, ROCM_PRIORITY,
                              reason)]


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    triton = [] if module_available("triton") else ["triton is not installed"]
    return [
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "cuda", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "cuda", PLUGIN, []),
    ]
