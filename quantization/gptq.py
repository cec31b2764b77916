"""GPTQ checkpoints (`quant_method: "gptq"`), 4 bits, repacked at load into our int4 layout.

On-disk layout (AutoGPTQ / GPTQModel / optimum), for a linear layer of [out, in]:
  `qweight` int32 [in / 8, out]: input row i of column o in bits 4 * (i % 8) of qweight[i // 8, o];
  `qzeros`  int32 [groups, out / 8]: zero point of column o in bits 4 * (o % 8) of
            qzeros[g, o // 8], stored minus one in the classic format (`checkpoint_format`
            "gptq", the default; "gptq_v2" stores it as is);
  `scales`  float16 [groups, out];
  `g_idx`   int32 [in]: the group of each input row (i // group_size unless `desc_act`).
  w[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. `sym` checkpoints store
  zero point 8 (7 in the classic format); asymmetric ones any value.
"""
from __future__ import annotations

import torch

from runtime.quantization.base import LinearMethod, QuantizationConfig
from runtime.quantization.packed_int4 import (Int4Shard, PackedInt4LinearMethod, canonical,
                                      check_group_size, group_size_for, unpack_int32)
from runtime.quantization.weight_only import Int4ReferenceKernel

FORMATS = ("gptq", "gptq_v2")


class GPTQLinearMethod(PackedInt4LinearMethod):
    name = "gptq"

    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(config, ("qweight", "qzeros", "scales", "g_idx"))

    def convert(self, shard):
        q = unpack_int32(shard["qweight"].t())  # [out, in]
        out, in_features = q.shape
        g = group_size_for("gptq", self.config.group_size, in_features)
        zeros = unpack_int32(shard["qzeros"])[:, :out].t().int()
        if self.config.checkpoint_format == "gptq":
            zeros = zeros + 1
        scales = shard["scales"].t()
        g_idx = shard["g_idx"].long()
        if g_idx.shape != (in_features,) or scales.shape != (out, in_features // g):
            raise ValueError(f"gptq: g_idx {tuple(g_idx.shape)} / scales "
                             f"{tuple(shard['scales'].shape)} do not fit a [{out}, {in_features}] "
                             f"weight with group size {g}")
        contiguous = torch.arange(in_features) // g
        perm = None
        if not torch.equal(g_idx, contiguous):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise ValueError(f"gptq: g_idx does not put {g} input rows in each group")
            q = q[:, perm]
        return Int4Shard(canonical(q, zeros, scales, g, self.dtype), perm)


class GPTQConfig(QuantizationConfig):
    """GPTQ 4-bit checkpoints, group-wise, symmetric or not, with or without act-order."""

    name = "gptq"
    kernel_method = "int4"
    fast_kernel_platforms = ("cpu",)
    weights_from = "GPTQ checkpoint"

    def __init__(self, group_size: int = 128, sym: bool = True,
                 checkpoint_format: str = "gptq") -> None:
        self.group_size = check_group_size("gptq", group_size)
        self.sym = sym
        if checkpoint_format not in FORMATS:
            raise ValueError(f"gptq checkpoint_format must be one of {FORMATS}, "
                             f"got {checkpoint_format!r}")
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_options(cls, options):
        raise ValueError("gptq is read from a GPTQ checkpoint's quantization_config; to quantize "
                         "a float checkpoint at load use --quantization int4")

    @classmethod
    def from_checkpoint(cls, config: dict) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"gptq checkpoints of {bits} bits are not supported; supported: 4")
        # desc_act needs no flag here: each layer's g_idx says whether its rows are permuted.
        return cls(int(config.get("group_size", 128)), bool(config.get("sym", True)),
                   config.get("checkpoint_format") or "gptq")

    def kernel_params(self) -> dict:
        return {"bits": 4, "group_size": self.group_size, "symmetric": self.sym}

    def reference_kernel(self):
        return Int4ReferenceKernel()

    def linear_method(self, prefix: str) -> LinearMethod:
        return GPTQLinearMethod(self)
