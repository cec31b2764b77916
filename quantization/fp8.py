"""FP8 (e4m3) weights with one fp32 scale per output channel: w ≈ float(q) * scale[row].

Where the weights come from:
- `--quantization fp8` on a float checkpoint: quantized at load, per output channel
  (scale = max|w_row| / 448), activations dynamic.
- a checkpoint with `{"quant_method": "fp8", "activation_scheme": "static"|"dynamic"}`:
  `*.weight` float8_e4m3fn [out, in], `*.weight_scale` fp32 scalar (per tensor), and with the
  static scheme `*.input_scale` fp32 scalar;
- a compressed-tensors checkpoint (`runtime.quantization.compressed_tensors`) whose weights are
  `{"type": "float", "num_bits": 8, "strategy": "tensor"|"channel"}`: the same tensor names,
  `weight_scale` [1] or [out, 1].

Per-tensor scales differ between the projections fused into one layer (q/k/v, gate/up); each
shard's scale is spread over its rows, so the fused layer keeps per-output-channel scales and no
weight is requantized. A static input scale is one per layer: the largest of the shards'.

Kernel interface (what `runtime_quantization_kernel(platform, "fp8", params)` returns):

    name: str
    supports(out_features, in_features) -> bool      # else the reference kernel takes the layer
    pack(layer, w: Fp8Weight) -> None                  # registers the layer's parameters
    apply(layer, x, bias) -> Tensor                    # y = x @ dequant(W).T + bias

`params` is {"activation_scheme": "dynamic"|"static"}. The reference kernel is weight-only
(fp8 weight resident, converted per call); `Fp8ScaledMMKernel` runs w8a8 through
`torch._scaled_mm` with per-token (dynamic) or static per-tensor activation scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from runtime.quantization.checkpoint import CheckpointLinearMethod, is_ignored, param

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass
class Fp8Weight:
    """qweight float8_e4m3fn [out, in]; scales fp32 [out]; input_scale fp32 scalar or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    input_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def rows(self, start: int, size: int) -> Fp8Weight:
        return Fp8Weight(self.qweight[start:start + size], self.scales[start:start + size],
                         self.input_scale)

    def cols(self, start: int, size: int) -> Fp8Weight:
        return Fp8Weight(self.qweight[:, start:start + size], self.scales, self.input_scale)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel, round to nearest e4m3."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q, scales)


def _quantize_activation(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8ReferenceKernel:
    """Portable weight-only: fp8 weight resident, converted to the activation dtype per call,
    the per-channel scale applied to the output."""

    name = "fp8_reference"

    def supports(self, out_features: int, in_features: int) -> bool:
        return True

    def pack(self, layer: nn.Module, w: Fp8Weight) -> None:
        layer.weight = param(w.qweight.contiguous())
        layer.weight_scale = param(w.scales.float().contiguous())
        layer.input_scale = None if w.input_scale is None else param(w.input_scale.float())

    def apply(self, layer, x, bias=None):
        y = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return y + bias if bias is not None else y


class Fp8ScaledMMKernel(Fp8ReferenceKernel):
    """w8a8: activations quantized to e4m3 (per token, or the checkpoint's static scale), one
    `torch._scaled_mm` with fp32 row/column scales. Needs hardware fp8 matmuls (CUDA sm89+);
    the platform plugin decides where it is offered."""

    name = "fp8_scaled_mm"

    def supports(self, out_features: int, in_features: int) -> bool:
        return out_features % 16 == 0 and in_features % 16 == 0  # _scaled_mm's alignment

    def apply(self, layer, x, bias=None):
        x2 = x.reshape(-1, x.shape[-1])
        if layer.input_scale is not None:
            scale_a = layer.input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        else:
            scale_a = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq, scale_b = _quantize_activation(x2, scale_a), layer.weight_scale.view(1, -1)
        if x.dtype == torch.bfloat16:  # row-wise scales are fused for bf16 outputs only
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=scale_a, scale_b=scale_b,
                                 out_dtype=torch.bfloat16)
        else:
            one = torch.ones((), dtype=torch.float32, device=x.device)
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=one, scale_b=one,
                                 out_dtype=torch.float32) * scale_a * scale_b
        y = y.to(x.dtype).view(*x.shape[:-1], -1)
        return y + bias if bias is not None else y


def _kernel_for(config: Fp8Config, rows: int, cols: int):
    kernel = config.kernel or config.reference_kernel()
    return kernel if kernel.supports(rows, cols) else config.reference_kernel()


class Fp8OnLoadLinearMethod(LinearMethod):
    """Float weight while loading; quantized per output channel afterwards."""

    name = "fp8"

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.kernel = None

    def create_weights(self, layer, input_size, output_size, params_dtype):
        layer.weight = param(torch.empty(output_size, input_size, dtype=params_dtype))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        del layer.weight
        self.kernel = _kernel_for(self.config, *w.shape)
        self.kernel.pack(layer, quantize_fp8(w))

    def apply(self, layer, x, bias=None):
        if self.kernel is None:
            return F.linear(x, layer.weight, bias)
        return self.kernel.apply(layer, x, bias)


class Fp8CheckpointLinearMethod(CheckpointLinearMethod):
    name = "fp8"

    def __init__(self, config: Fp8Config) -> None:
        names = ("weight", "weight_scale") + (("input_scale",) if config.static else ())
        super().__init__(names)
        self.config = config

    def convert(self, tensors):
        weight, scale = tensors["weight"], tensors["weight_scale"].float().reshape(-1)
        if weight.dtype != FP8:
            raise ValueError(f"fp8 checkpoint weights must be float8_e4m3fn, got {weight.dtype}")
        rows = weight.shape[0]
        if scale.numel() not in (1, rows):
            raise ValueError(f"fp8 weight_scale must hold 1 (per tensor) or {rows} (per channel) "
                             f"values, got shape {tuple(tensors['weight_scale'].shape)}")
        input_scale = tensors["input_scale"].float().reshape(()) if self.config.static else None
        return Fp8Weight(weight, scale.expand(rows), input_scale)

    def pack(self, layer, weights):
        qweight = torch.cat([w.qweight for w in weights])
        self.check_rows(*qweight.shape)
        input_scale = (torch.stack([w.input_scale for w in weights]).max()
                       if self.config.static else None)
        self.kernel = _kernel_for(self.config, *qweight.shape)
        self.kernel.pack(layer, Fp8Weight(qweight, torch.cat([w.scales for w in weights]),
                                          input_scale))

    def apply(self, layer, x, bias=None):
        return self.kernel.apply(layer, x, bias)


class Fp8Config(QuantizationConfig):
    """FP8 e4m3 weights, per-channel scales; w8a8 where the platform offers it."""

    name = "fp8"
    fast_kernel_platforms = ("cuda (sm89+)",)
    weights_from = "float checkpoint (at load); fp8 or compressed-tensors checkpoint"

    def __init__(self, from_checkpoint: bool = False, static: bool = False,
                 ignore: list[str] | None = None) -> None:
        self.from_ckpt = from_checkpoint
        self.static = static
        self.ignore = ignore or []

    @classmethod
    def from_checkpoint(cls, config: dict) -> Fp8Config:
        if config.get("weight_block_size"):
            raise ValueError(f"block-wise fp8 (weight_block_size {config['weight_block_size']}) "
                             "is not supported; fp8 checkpoints must have per-tensor or "
                             "per-channel weight scales")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 activation_scheme must be 'static' or 'dynamic', got {scheme!r}")
        ignore = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(True, scheme == "static", list(ignore))

    def kernel_params(self) -> dict:
        return {"activation_scheme": "static" if self.static else "dynamic"}

    def reference_kernel(self):
        return Fp8ReferenceKernel()

    def linear_method(self, prefix: str) -> LinearMethod:
        if not self.from_ckpt:
            return Fp8OnLoadLinearMethod(self)
        if is_ignored(prefix, self.ignore):
            return UnquantizedLinearMethod()
        return Fp8CheckpointLinearMethod(self)
