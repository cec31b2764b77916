"""AWQ checkpoints (`quant_method: "awq"`, AutoAWQ's GEMM layout), 4 bits, repacked at load into
our int4 layout.

On-disk layout, for a linear layer of [out, in]:
  `qweight` int32 [in, out / 8]: eight output columns per int32, nibble k (bits 4k) holding
            column 8 * c + [0, 2, 4, 6, 1, 3, 5, 7][k] of packed column c;
  `qzeros`  int32 [groups, out / 8]: zero points, packed the same way (not minus one);
  `scales`  float16 [groups, out].
  w[o, i] = scales[i // group_size, o] * (q[i, o] - zero[i // group_size, o]).
"""
from __future__ import annotations

import torch

from runtime.quantization.base import LinearMethod, QuantizationConfig
from runtime.quantization.packed_int4 import (Int4Shard, PackedInt4LinearMethod, canonical,
                                      check_group_size, group_size_for, unpack_int32)
from runtime.quantization.weight_only import Int4ReferenceKernel

# Where each column of eight sits among the unpacked nibbles (the inverse of AWQ's packing order).
NIBBLE_OF_COLUMN = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] int32 -> [rows, out] uint8, columns in natural order."""
    q = unpack_int32(packed)
    return q.view(q.shape[0], -1, 8)[..., NIBBLE_OF_COLUMN].reshape(q.shape[0], -1)


class AWQLinearMethod(PackedInt4LinearMethod):
    name = "awq"

    def __init__(self, config: AWQConfig) -> None:
        super().__init__(config, ("qweight", "qzeros", "scales"))

    def convert(self, shard):
        q = unpack_awq(shard["qweight"]).t()  # [out, in]
        out, in_features = q.shape
        g = group_size_for("awq", self.config.group_size, in_features)
        zeros, scales = unpack_awq(shard["qzeros"]).t(), shard["scales"].t()
        if scales.shape != (out, in_features // g) or zeros.shape != scales.shape:
            raise ValueError(f"awq: qzeros {tuple(shard['qzeros'].shape)} / scales "
                             f"{tuple(shard['scales'].shape)} do not fit a [{out}, "
                             f"{in_features}] weight with group size {g}")
        return Int4Shard(canonical(q, zeros, scales, g, self.dtype))


class AWQConfig(QuantizationConfig):
    """AWQ 4-bit checkpoints (GEMM layout), group-wise with zero points."""

    name = "awq"
    kernel_method = "int4"
    fast_kernel_platforms = ("cpu",)
    weights_from = "AWQ checkpoint (GEMM)"

    def __init__(self, group_size: int = 128) -> None:
        self.group_size = check_group_size("awq", group_size)

    @classmethod
    def from_options(cls, options):
        raise ValueError("awq is read from an AWQ checkpoint's quantization_config; to quantize "
                         "a float checkpoint at load use --quantization int4")

    @classmethod
    def from_checkpoint(cls, config: dict) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"awq checkpoints of {bits} bits are not supported; supported: 4")
        if not config.get("zero_point", True):
            raise ValueError("awq checkpoints without zero points are not supported; supported: "
                             "zero_point true")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported; supported: 'gemm'")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))))

    def kernel_params(self) -> dict:
        return {"bits": 4, "group_size": self.group_size, "symmetric": False}

    def reference_kernel(self):
        return Int4ReferenceKernel()

    def linear_method(self, prefix: str) -> LinearMethod:
        return AWQLinearMethod(self)
