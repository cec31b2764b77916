"""Weight-only integer quantization applied at load time to a float checkpoint.

- `int8`: per-output-channel symmetric, w ≈ q * scale, q in [-127, 127].
- `int4`: group-wise along the input dimension (group size 32, 64 or 128), symmetric or
  asymmetric, in one canonical form: q in [0, 15], w ≈ (q - 8) * scale + zero, one (scale, zero)
  per group (symmetric: zero = 0). This is the form torch's int4 pack kernels take.

The float weight is loaded as usual (so every weight loader — QKV, merged, row/column parallel —
works unchanged); `process_weights_after_loading` quantizes it and hands the result to the kernel.

Kernel interface (what `runtime_quantization_kernel(platform, "int8"|"int4", params)` returns):

    name: str
    supports(out_features, in_features) -> bool      # else the reference kernel takes the layer
    pack(layer, q: QuantizedWeight) -> None            # registers the layer's parameters
    apply(layer, x, bias) -> Tensor                    # y = x @ dequant(W).T + bias

`params` is {"bits": 8|4, "group_size": int|None, "symmetric": bool}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.quantization.base import LinearMethod, QuantizationConfig

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedWeight:
    """A quantized [out, in] weight. int8: qweight int8, scales [out], zeros None.
    int4: qweight uint8 in [0, 15] (unpacked), scales/zeros [out, in // group_size]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def rows(self, start: int, size: int) -> QuantizedWeight:
        zeros = None if self.zeros is None else self.zeros[start:start + size]
        return QuantizedWeight(self.qweight[start:start + size], self.scales[start:start + size],
                               zeros, self.group_size)

    def cols(self, start: int, size: int) -> QuantizedWeight:
        """Input features [start, start + size): whole groups only."""
        q = self.qweight[:, start:start + size]
        if self.group_size is None:
            return QuantizedWeight(q, self.scales)
        g = self.group_size
        if start % g or size % g:
            raise ValueError(f"a tensor-parallel shard of {size} input features does not hold "
                             f"whole quantization groups of {g}")
        return QuantizedWeight(q, self.scales[:, start // g:(start + size) // g],
                               self.zeros[:, start // g:(start + size) // g], g)

    def dequantize(self) -> torch.Tensor:
        if self.zeros is None:
            return self.qweight.float() * self.scales.float()[:, None]
        n, k = self.qweight.shape
        g = self.group_size
        q = self.qweight.float().view(n, k // g, g) - 8
        return (q * self.scales.float()[..., None] + self.zeros.float()[..., None]).view(n, k)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scales)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool,
                  scale_dtype: torch.dtype) -> QuantizedWeight:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: input size {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = (g.abs().amax(dim=2) / 7.5).clamp(min=1e-10).to(scale_dtype)
        zeros = torch.zeros_like(scales)
        q = torch.round(g / scales.float()[..., None]).clamp(-8, 7) + 8
    else:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scales = ((hi - lo) / 15).clamp(min=1e-10).to(scale_dtype)
        q = torch.round((g - lo[..., None]) / scales.float()[..., None]).clamp(0, 15)
        zeros = (lo + 8 * scales.float()).to(scale_dtype)
        # Re-fit q to the stored (rounded) scale and zero, so dequantize() is the exact model.
        q = torch.round((g - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return QuantizedWeight(q.to(torch.uint8).view(n, k), scales, zeros, group_size)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Int8ReferenceKernel:
    """Portable: int8 weight resident, converted per call; scale applied to the output."""

    name = "int8_reference"

    def supports(self, out_features: int, in_features: int) -> bool:
        return True

    def pack(self, layer: nn.Module, q: QuantizedWeight) -> None:
        layer.qweight = _param(q.qweight.contiguous())
        layer.scales = _param(q.scales)

    def apply(self, layer, x, bias=None):
        y = F.linear(x, layer.qweight.to(x.dtype)) * layer.scales.to(x.dtype)
        return y + bias if bias is not None else y


class Int4ReferenceKernel:
    """Portable: two 4-bit values per byte (low nibble first); the layer's weight is
    dequantized per call (vectorised over groups), then one dense matmul."""

    name = "int4_reference"

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % 2 == 0

    def pack(self, layer: nn.Module, q: QuantizedWeight) -> None:
        qw = q.qweight
        layer.qweight = _param((qw[:, 0::2] | (qw[:, 1::2] << 4)).contiguous())
        layer.scales = _param(q.scales.contiguous())
        layer.zeros = _param(q.zeros.contiguous())
        layer.group_size = q.group_size

    @staticmethod
    def dequantize(layer, dtype: torch.dtype) -> torch.Tensor:
        packed = layer.qweight
        n, half = packed.shape
        g = layer.group_size
        q = torch.stack((packed & 15, packed >> 4), dim=-1).view(n, -1, g).to(dtype) - 8
        w = q * layer.scales.to(dtype)[..., None] + layer.zeros.to(dtype)[..., None]
        return w.view(n, 2 * half)

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantize(layer, x.dtype), bias)


class WeightOnlyLinearMethod(LinearMethod):
    """Float weight while loading; quantized and packed for the kernel afterwards."""

    def __init__(self, config: WeightOnlyConfig) -> None:
        self.config = config
        self.name = config.name
        self.kernel = None

    def create_weights(self, layer, input_size, output_size, params_dtype):
        layer.weight = _param(torch.empty(output_size, input_size, dtype=params_dtype))
        self.scale_dtype = params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        del layer.weight
        q = self.config.quantize(w, self.scale_dtype)
        kernel = self.config.kernel or self.config.reference_kernel()
        if not kernel.supports(*w.shape):
            kernel = self.config.reference_kernel()
        kernel.pack(layer, q)
        self.kernel = kernel

    def apply(self, layer, x, bias=None):
        if self.kernel is None:  # not yet quantized (e.g. a forward pass before loading ends)
            return F.linear(x, layer.weight, bias)
        return self.kernel.apply(layer, x, bias)


class WeightOnlyConfig(QuantizationConfig):
    bits: int = 0
    weights_from = "float checkpoint (at load)"

    def linear_method(self, prefix: str) -> LinearMethod:
        return WeightOnlyLinearMethod(self)


class Int8Config(WeightOnlyConfig):
    """Weight-only int8, per output channel, symmetric."""

    name = "int8"
    bits = 8
    fast_kernel_platforms = ("cpu",)

    def kernel_params(self) -> dict:
        return {"bits": 8, "group_size": None, "symmetric": True}

    def quantize(self, w: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        return quantize_int8(w, scale_dtype)

    def reference_kernel(self):
        return Int8ReferenceKernel()


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "sym", "symmetric"):
        return True
    if value.lower() in ("0", "false", "no", "asym", "asymmetric"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


class Int4Config(WeightOnlyConfig):
    """Weight-only int4, group-wise along the input dimension."""

    name = "int4"
    bits = 4
    fast_kernel_platforms = ("cpu",)

    def __init__(self, group_size: int = 128, symmetric: bool = True) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        self.symmetric = symmetric

    @classmethod
    def from_options(cls, options):
        unknown = set(options) - {"group_size", "symmetric"}
        if unknown:
            raise ValueError(f"int4 options are group_size and symmetric, got {sorted(unknown)}")
        return cls(int(options.get("group_size", 128)),
                   _flag(options.get("symmetric", "1")))

    def kernel_params(self) -> dict:
        return {"bits": 4, "group_size": self.group_size, "symmetric": self.symmetric}

    def group_size_for(self, in_features: int) -> int:
        """The configured group size, or the largest smaller one that divides `in_features`
        (SmolLM2's 576 takes 64 when 128 is asked for)."""
        for g in sorted(INT4_GROUP_SIZES, reverse=True):
            if g <= self.group_size and in_features % g == 0:
                return g
        raise ValueError(f"int4: input size {in_features} is not a multiple of any group size "
                         f"up to {self.group_size}")

    def quantize(self, w: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        return quantize_int4(w, self.group_size_for(w.shape[1]), self.symmetric, scale_dtype)

    def reference_kernel(self):
        return Int4ReferenceKernel()
