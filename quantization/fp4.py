"""MXFP4 and NVFP4 weights (4-bit e2m1 floats in blocks along the input dimension), read from
compressed-tensors checkpoints and run through a reference kernel on any device: the layer keeps
the packed codes and block scales, and dequantizes them at each call before one dense matmul.

On-disk layout (compressed-tensors `mxfp4-pack-quantized` / `nvfp4-pack-quantized`), for a
linear layer of [out, in]:
  `weight_packed` uint8 [out, in / 2]: two e2m1 codes per byte, the low nibble first (column
                  2j in the low nibble, 2j + 1 in the high one); code bit 3 is the sign, bits 0-2
                  index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  MXFP4: `weight_scale` uint8 [out, in / 32], an e8m0 exponent (biased by 127) per block of 32:
         w = e2m1 * 2 ** (weight_scale - 127).
  NVFP4: `weight_scale` float8_e4m3fn [out, in / 16], one per block of 16, and
         `weight_global_scale` float32 [1], a divisor (compressed-tensors' convention):
         w = e2m1 * weight_scale / weight_global_scale. With quantized activations configured
         the checkpoint also holds `input_global_scale`, which is read and not used: the
         reference kernel is weight-only.
The projections fused into one layer have their own global scales; the layer keeps one divisor
per output row.

Kernel interface (what `runtime_quantization_kernel(platform, "mxfp4"|"nvfp4", params)` returns):

    name: str
    pack(layer, w: Fp4Weight) -> None
    apply(layer, x, bias) -> Tensor

`params` is {"block_size": 32|16, "scale_format": "e8m0"|"e4m3"}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from runtime.quantization.checkpoint import CheckpointLinearMethod, is_ignored, param

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[rows, n] uint8 -> [rows, 2n] float32, low nibble first."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return E2M1.to(packed.device)[codes.long()]


@dataclass
class Fp4Weight:
    """packed uint8 [out, in / 2]; scales [out, in / block] (uint8 e8m0 or float8_e4m3fn);
    global_scale float32 [out] (NVFP4's divisor per row) or None."""

    packed: torch.Tensor
    scales: torch.Tensor
    block_size: int
    global_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def rows(self, start: int, size: int) -> Fp4Weight:
        gs = None if self.global_scale is None else self.global_scale[start:start + size]
        return Fp4Weight(self.packed[start:start + size], self.scales[start:start + size],
                         self.block_size, gs)

    def cols(self, start: int, size: int) -> Fp4Weight:
        b = self.block_size
        if start % b or size % b:
            raise ValueError(f"a tensor-parallel shard of {size} input features does not hold "
                             f"whole blocks of {b}")
        return Fp4Weight(self.packed[:, start // 2:(start + size) // 2],
                         self.scales[:, start // b:(start + size) // b], b, self.global_scale)

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp4(self.packed, self.scales, self.block_size, self.global_scale)


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents (uint8) or float8 block scales -> float32."""
    if scales.dtype == torch.uint8:
        return torch.exp2(scales.float() - 127)
    return scales.float()


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, block_size: int,
                   global_scale: torch.Tensor | None) -> torch.Tensor:
    rows = packed.shape[0]
    s = block_scales(scales)
    if global_scale is not None:
        s = s / global_scale[:, None]
    w = unpack_e2m1(packed).view(rows, -1, block_size) * s[..., None]
    return w.view(rows, -1)


class Fp4ReferenceKernel:
    """Dequantize the layer (float32, vectorised over blocks), then one dense matmul."""

    name = "fp4_reference"

    def pack(self, layer, w: Fp4Weight) -> None:
        layer.weight_packed = param(w.packed.contiguous())
        layer.weight_scale = param(w.scales.contiguous())
        layer.weight_global_scale = (None if w.global_scale is None else
                                     param(w.global_scale.float().contiguous()))
        layer.block_size = w.block_size

    def apply(self, layer, x, bias=None):
        w = dequantize_fp4(layer.weight_packed, layer.weight_scale, layer.block_size,
                           layer.weight_global_scale)
        return F.linear(x, w.to(x.dtype), bias)


class Fp4LinearMethod(CheckpointLinearMethod):
    def __init__(self, config: Fp4Config) -> None:
        names = ("weight_packed", "weight_scale") + config.extra_tensors
        super().__init__(names)
        self.name = config.name
        self.config = config

    def convert(self, tensors):
        packed, scales = tensors["weight_packed"], tensors["weight_scale"]
        if scales.dtype == torch.float8_e8m0fnu:  # the same bytes under safetensors' F8_E8M0
            scales = scales.view(torch.uint8)
        rows, cols, b = packed.shape[0], 2 * packed.shape[1], self.config.block_size
        if packed.dtype != torch.uint8 or scales.dtype != self.config.scale_dtype or \
                scales.shape != (rows, cols // b):
            raise ValueError(f"{self.name}: expected weight_packed uint8 [{rows}, {cols // 2}] and "
                             f"weight_scale {self.config.scale_dtype} [{rows}, {cols // b}], got "
                             f"{packed.dtype} {tuple(packed.shape)} and {scales.dtype} "
                             f"{tuple(scales.shape)}")
        global_scale = None
        if self.config.global_scale:
            global_scale = tensors["weight_global_scale"].float().reshape(1).expand(rows)
        return Fp4Weight(packed, scales, b, global_scale)

    def pack(self, layer, weights):
        packed = torch.cat([w.packed for w in weights])
        self.check_rows(packed.shape[0], 2 * packed.shape[1])
        global_scale = (torch.cat([w.global_scale for w in weights])
                        if self.config.global_scale else None)
        self.kernel = self.config.kernel or self.config.reference_kernel()
        self.kernel.pack(layer, Fp4Weight(packed, torch.cat([w.scales for w in weights]),
                                          self.config.block_size, global_scale))

    def apply(self, layer, x, bias=None):
        return self.kernel.apply(layer, x, bias)


class Fp4Config(QuantizationConfig):
    block_size: int = 0
    scale_dtype: torch.dtype = torch.uint8
    global_scale: bool = False

    def __init__(self, ignore: list[str] | None = None, input_global_scale: bool = False) -> None:
        self.ignore = ignore or []
        self.extra_tensors: tuple[str, ...] = ()
        if self.global_scale:
            self.extra_tensors = ("weight_global_scale",) + (
                ("input_global_scale",) if input_global_scale else ())

    @classmethod
    def from_options(cls, options):
        raise ValueError(f"{cls.name} is read from a compressed-tensors checkpoint "
                         f"(format {cls.name}-pack-quantized); it is not applied at load")

    def kernel_params(self) -> dict:
        return {"block_size": self.block_size,
                "scale_format": "e8m0" if self.scale_dtype == torch.uint8 else "e4m3"}

    def reference_kernel(self):
        return Fp4ReferenceKernel()

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_ignored(prefix, self.ignore):
            return UnquantizedLinearMethod()
        return Fp4LinearMethod(self)


class Mxfp4Config(Fp4Config):
    """OCP MXFP4: e2m1 in blocks of 32, one power-of-two (e8m0) scale per block."""

    name = "mxfp4"
    block_size = 32
    weights_from = ("compressed-tensors checkpoint (mxfp4-pack-quantized); transformers' "
                    "quant_method mxfp4 (gpt-oss experts)")

    @classmethod
    def from_checkpoint(cls, config: dict) -> Mxfp4ExpertsConfig:
        """transformers' own MXFP4 format (`quant_method: mxfp4`, gpt-oss)."""
        return Mxfp4ExpertsConfig()


class Mxfp4ExpertsConfig(Mxfp4Config):
    """transformers' MXFP4 checkpoints (gpt-oss): only the MoE experts are quantized, each
    stacked projection stored as `<name>_blocks` uint8 [E, out, in / 32, 16] (two e2m1 codes
    per byte, the low nibble first) and `<name>_scales` uint8 e8m0 [E, out, in / 32]. Every
    linear layer stays dense; the model class that owns the experts decodes them
    (`dequantize_mx_blocks`) as they load."""

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()


def dequantize_mx_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 `_blocks` [..., out, in / 32, 16] and `_scales` [..., out, in / 32]
    -> float32 [..., out, in] (exact: e2m1 times a power of two)."""
    *lead, groups, width = blocks.shape
    packed = blocks.reshape(-1, groups * width)
    dense = dequantize_fp4(packed, scales.reshape(-1, groups), 32, None)
    return dense.view(*lead, groups * width * 2)


class Nvfp4Config(Fp4Config):
    """NVFP4: e2m1 in blocks of 16, an fp8 e4m3 scale per block, an fp32 global divisor."""

    name = "nvfp4"
    block_size = 16
    weights_from = "compressed-tensors checkpoint (nvfp4-pack-quantized)"
    scale_dtype = torch.float8_e4m3fn
    global_scale = True
