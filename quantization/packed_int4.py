"""GPTQ and AWQ checkpoints repacked at load into our int4 layout (`runtime.quantization.weight_only`),
so that they run through the int4 kernels.

Both store 4-bit weights packed eight to an int32, a scale and a zero point per group of input
rows, and dequantize as w = scale * (q - zero). In our canonical int4 form, w = (q - 8) * scale +
zero', so zero' = scale * (8 - zero): exact for any zero point, symmetric or not.

GPTQ with `desc_act` (activation order) assigns input rows to groups through `g_idx`; the rows
are then permuted at load so that every group is contiguous, and the layer permutes its input
the same way at each call (`x[..., perm]`), so the fast int4 kernels still apply.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.quantization.checkpoint import CheckpointLinearMethod, param
from runtime.quantization.weight_only import INT4_GROUP_SIZES, QuantizedWeight

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values per int32 along the last dimension, lowest bits first:
    [..., n] int32 -> [..., 8 * n] uint8 in [0, 15]."""
    q = (packed.to(torch.int32).unsqueeze(-1) >> SHIFTS.to(packed.device)) & 15
    return q.flatten(-2).to(torch.uint8)


@dataclass
class Int4Shard:
    """One checkpoint shard in the int4 form, and its input permutation (None: identity)."""

    q: QuantizedWeight
    perm: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.q.out_features

    def rows(self, start: int, size: int) -> Int4Shard:
        return Int4Shard(self.q.rows(start, size), self.perm)

    def cols(self, start: int, size: int) -> Int4Shard:
        if self.perm is not None:
            raise NotImplementedError("act-order (desc_act) GPTQ layers do not split their input "
                                      "over tensor-parallel ranks yet")
        return Int4Shard(self.q.cols(start, size))


def canonical(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> QuantizedWeight:
    """q uint8 [out, in]; zeros (integer zero points) and scales [out, in // group_size]."""
    s = scales.float()
    return QuantizedWeight(q.contiguous(), s.to(dtype), (s * (8 - zeros.float())).to(dtype),
                           group_size)


class PackedInt4LinearMethod(CheckpointLinearMethod):
    """Each shard converted to the int4 form (`convert`: an `Int4Shard`), fused, packed."""

    def __init__(self, config, tensor_names: tuple[str, ...]) -> None:
        super().__init__(tensor_names)
        self.config = config
        self.perm: torch.Tensor | None = None

    def pack(self, layer, weights):
        perms = [w.perm for w in weights]
        if any(p is not None for p in perms):
            if not all(p is not None and torch.equal(p, perms[0]) for p in perms):
                raise ValueError(f"{self.name}: the projections fused into one layer have "
                                 "different g_idx (act-order) permutations")
            self.perm = perms[0].to(torch.int32)
            layer.input_perm = param(self.perm)
        qs = [w.q for w in weights]
        q = QuantizedWeight(torch.cat([x.qweight for x in qs]), torch.cat([x.scales for x in qs]),
                            torch.cat([x.zeros for x in qs]), qs[0].group_size)
        self.check_rows(*q.qweight.shape)
        kernel = self.config.kernel or self.config.reference_kernel()
        if q.group_size not in INT4_GROUP_SIZES or not kernel.supports(*q.qweight.shape):
            kernel = self.config.reference_kernel()
        kernel.pack(layer, q)
        self.kernel = kernel

    def apply(self, layer, x, bias=None):
        if self.perm is not None:
            x = x.index_select(-1, layer.input_perm)
        return self.kernel.apply(layer, x, bias)


def check_group_size(method: str, group_size: int) -> int:
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"{method} group_size must be -1 (one group per row) or positive, "
                         f"got {group_size}")
    return group_size


def group_size_for(method: str, group_size: int, in_features: int) -> int:
    g = in_features if group_size == -1 else group_size
    if in_features % g or g % 2:
        raise ValueError(f"{method}: group size {group_size} does not divide the input size "
                         f"{in_features} into groups of an even size")
    return g
