"""Weight-only int8/int4 kernels from torch's own CPU ops (`aten::_weight_int8pack_mm`,
`aten::_weight_int4pack_mm_for_cpu`). The CPU platform answers the quantization-kernel hook with
these. Same interface as the reference kernels in `runtime.quantization.weight_only`.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from runtime.quantization.weight_only import QuantizedWeight


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Int8PackKernel:
    name = "cpu_int8pack_mm"

    def supports(self, out_features: int, in_features: int) -> bool:
        return True

    def pack(self, layer: nn.Module, q: QuantizedWeight) -> None:
        layer.qweight = nn.Parameter(q.qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(q.scales, requires_grad=False)

    def apply(self, layer, x, bias=None):
        y = torch._weight_int8pack_mm(_flat(x), layer.qweight, layer.scales.to(x.dtype))
        y = y.view(*x.shape[:-1], -1)
        return y + bias if bias is not None else y


class Int4PackKernel:
    """tinygemm layout: weight packed by `_convert_weight_to_int4pack_for_cpu`, and
    [in // group, out, 2] (scale, zero) pairs with w = (q - 8) * scale + zero."""

    name = "cpu_int4pack_mm"

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % 2 == 0

    def pack(self, layer: nn.Module, q: QuantizedWeight) -> None:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.qweight.to(torch.int32), 2)
        layer.qweight = nn.Parameter(packed, requires_grad=False)
        sz = torch.stack((q.scales.t(), q.zeros.t()), dim=-1).contiguous()
        layer.scales_and_zeros = nn.Parameter(sz, requires_grad=False)
        layer.group_size = q.group_size

    def apply(self, layer, x, bias=None):
        sz = layer.scales_and_zeros
        if sz.dtype != x.dtype:
            sz = sz.to(x.dtype)
        y = torch._weight_int4pack_mm_for_cpu(_flat(x), layer.qweight, layer.group_size, sz)
        y = y.view(*x.shape[:-1], -1)
        return y + bias if bias is not None else y


# torch vectorises these two ops for AVX-512 CPUs; elsewhere (AVX2 only) they fall back to loops
# measured 3-15x slower than the reference kernel (dequantize, then one dense matmul).
FAST_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX", "AMX_TILE")
KERNEL_ENV = "RUNTIME_CPU_QUANT_KERNEL"  # "native" or "reference" overrides the choice


def native_kernels_are_fast() -> bool:
    forced = os.environ.get(KERNEL_ENV)
    if forced in ("native", "reference"):
        return forced == "native"
    return torch.backends.cpu.get_cpu_capability() in FAST_CAPABILITIES


def cpu_quantization_kernel(method: str, params: dict):
    """The CPU kernel for `method`, or None (the method's reference kernel then runs)."""
    if not native_kernels_are_fast():
        return None
    if method == "int8":
        return Int8PackKernel()
    if method == "int4":
        return Int4PackKernel()
    return None
