"""GGUF-native weights: linear layers keep llama.cpp's quantized blocks in memory and dequantize
them on the fly, one layer at a time, with torch ops vectorised over blocks.

Chosen by `--quantization gguf` on a .gguf model. The GGUF loader then yields each quantized
linear weight as a `GGUFWeight` (raw bytes, [rows, bytes per row]; rows are independent in GGUF,
so QKV / gate-up fusion and llama's q/k row permutation work on raw rows). A fused layer whose
parts have different types keeps one segment per type.

Kernel interface (what `runtime_quantization_kernel(platform, "gguf", params)` returns):

    name: str
    supports(qtype: int) -> bool
    apply(segments, x, bias) -> Tensor      # segments: list of (qtype, raw uint8 tensor, out rows)

`params` is {"types": [ggml type names the reference handles]}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.quantization.base import LinearMethod, QuantizationConfig

QK_K = 256
# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
              8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
              14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


@dataclass
class GGUFWeight:
    """One GGUF tensor's raw bytes as the loader yields it: [rows, bytes per row]."""

    qtype: int
    data: torch.Tensor  # uint8
    shape: tuple[int, int]  # the dequantized [out, in]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per `chunk` bytes: the low nibbles, then the high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk)
    return torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, -1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def dequantize_blocks(qtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """[n_blocks, bytes per block] uint8 -> [n_blocks, elements per block] float32."""
    name = GGML_TYPES[qtype][0]
    n = blocks.shape[0]
    if name == "F32":
        return blocks.contiguous().view(torch.float32)
    if name == "F16":
        return blocks.contiguous().view(torch.float16).float()
    if name == "BF16":
        return blocks.contiguous().view(torch.bfloat16).float()
    if name == "Q8_0":
        return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if name == "Q4_0":
        return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:], 16).float() - 8)
    if name == "Q4_1":
        return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:], 16).float() + _f16(blocks[:, 2:4])
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale, offset = (d * sc)[..., None], (dmin * mn)[..., None]
        if name == "Q4_K":
            q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
        else:
            qh = blocks[:, 16:48].reshape(n, 1, 32)
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
            high = (qh >> shifts) & 1
            q = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32) | (high << 4)
        return (scale * q.float() - offset).reshape(n, QK_K)
    if name == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = (_f16(blocks[:, 208:210]) * scales).reshape(n, 16, 1)
        low = _nibbles(ql, 64).reshape(n, -1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, -1, 32)
        q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, -1).float()
        return (d * q).reshape(n, QK_K)
    raise NotImplementedError(f"GGUF type {name} has no reference dequantization")


def dequantize(qtype: int, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Raw rows [out, bytes per row] of `qtype` -> float32 [out, in]."""
    size = GGML_TYPES[qtype][2]
    return dequantize_blocks(qtype, data.reshape(-1, size)).reshape(shape)


class GGUFReferenceKernel:
    """Dequantize each segment's blocks to the activation dtype, then one dense matmul."""

    name = "gguf_reference"

    def supports(self, qtype: int) -> bool:
        return qtype in GGML_TYPES

    def apply(self, segments, x, bias=None):
        parts = [dequantize(qtype, data, (rows, -1)).to(x.dtype) for qtype, data, rows in segments]
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return F.linear(x, w, bias)


class GGUFLinearMethod(LinearMethod):
    """Collects the raw GGUF parts of a layer while loading; fuses equal-typed parts after."""

    name = "gguf"
    custom_loader = True

    def __init__(self, config: GGUFConfig) -> None:
        self.config = config
        self.parts: dict = {}
        self.segments: list[tuple[int, str, int]] = []

    def create_weights(self, layer, input_size, output_size, params_dtype):
        # A placeholder the loader fills (named, so that the loaded-weights check sees it).
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        self.input_size, self.output_size, self.dtype = input_size, output_size, params_dtype

    def load_weight(self, layer, param, loaded, shard_id=None) -> None:
        if getattr(layer, "tp_size", 1) > 1:
            raise NotImplementedError("GGUF-native weights do not shard over tensor parallel "
                                      "ranks yet; drop --quantization gguf")
        if not isinstance(loaded, GGUFWeight):  # a float tensor (F32/F16 in the file)
            loaded = GGUFWeight(0, loaded.float().contiguous().view(torch.uint8)
                                .reshape(loaded.shape[0], -1), tuple(loaded.shape))
        self.parts[shard_id] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        order = {"q": 0, "k": 1, "v": 2}
        parts = [self.parts[k] for k in sorted(self.parts, key=lambda k: order.get(k, k or 0))]
        rows = sum(p.shape[0] for p in parts)
        if rows != self.output_size or any(p.shape[1] != self.input_size for p in parts):
            raise ValueError(f"GGUF weights of {rows} rows do not fit a layer of "
                             f"[{self.output_size}, {self.input_size}]")
        del layer.weight
        segments = []  # runs of consecutive parts of one type become one tensor
        for p in parts:
            if segments and segments[-1][0] == p.qtype:
                segments[-1][1].append(p.data)
                segments[-1][2] += p.shape[0]
            else:
                segments.append([p.qtype, [p.data], p.shape[0]])
        self.segments = []
        for i, (qtype, datas, n) in enumerate(segments):
            name = f"qweight_{i}" if len(segments) > 1 else "qweight"
            data = datas[0] if len(datas) == 1 else torch.cat(datas, dim=0)
            setattr(layer, name, nn.Parameter(data.contiguous(), requires_grad=False))
            self.segments.append((qtype, name, n))
        self.parts = {}
        self.kernel = self.config.kernel or self.config.reference_kernel()
        if not all(self.kernel.supports(q) for q, _, _ in self.segments):
            self.kernel = self.config.reference_kernel()

    def apply(self, layer, x, bias=None):
        segments = [(q, getattr(layer, name), n) for q, name, n in self.segments]
        return self.kernel.apply(segments, x, bias)


class GGUFConfig(QuantizationConfig):
    """llama.cpp block quantization kept as is (only for .gguf models)."""

    name = "gguf"
    raw_gguf_weights = True
    weights_from = ".gguf file"

    def linear_method(self, prefix: str) -> LinearMethod:
        return GGUFLinearMethod(self)

    def kernel_params(self) -> dict:
        return {"types": [GGML_TYPES[t][0] for t in GGML_TYPES]}

    def reference_kernel(self):
        return GGUFReferenceKernel()
