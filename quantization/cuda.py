"""The quantization kernels the CUDA platform supplies through the quantization-kernel hook."""
from __future__ import annotations

from runtime.quantization.fp8 import Fp8ScaledMMKernel

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: hardware e4m3 matmuls behind torch._scaled_mm


def cuda_quantization_kernel(method: str, params: dict, capability: tuple[int, int]):
    """The kernel for `method` on a GPU of compute `capability`, or None (the reference runs)."""
    if method == "fp8" and capability >= FP8_MIN_CAPABILITY:
        return Fp8ScaledMMKernel()
    return None
