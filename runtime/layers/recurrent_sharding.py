"""Tensor-parallel shards of the recurrent layers (gated delta-net, Mamba 1 and 2, short conv):
which rows of a checkpoint tensor's first dimension one rank holds, and the layers and
parameters that load only those rows.

A recurrent layer's fused tensors (an input projection, a conv over several parts) are the
concatenation of parts; each part is either split over the ranks in equal consecutive slices
(heads, channels) or replicated whole on every rank (Mamba 2's B and C with one group). A
rank's rows are its slice of every part, in part order, so the local tensors keep the
checkpoint's layout and each rank's state cache holds its heads' share of the state.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.linear import LinearBase

Part = tuple[int, bool]  # (size, split over the ranks)


def split(count: int, tp_size: int, what: str) -> int:
    """`count` heads (or channels, groups) over the ranks: how many each rank holds."""
    if count % tp_size:
        raise ValueError(f"tensor parallel: {what} ({count}) do not split over "
                         f"tensor-parallel size {tp_size}")
    return count // tp_size


def shard_rows(parts: list[Part], tp_rank: int, tp_size: int, what: str = "") -> torch.Tensor:
    """Indices into the concatenated parts of the rows rank `tp_rank` holds."""
    rows, start = [], 0
    for size, sharded in parts:
        if sharded:
            shard = split(size, tp_size, f"{what} channels")
            rows.append(torch.arange(start + tp_rank * shard, start + (tp_rank + 1) * shard))
        else:
            rows.append(torch.arange(start, start + size))
        start += size
    return torch.cat(rows)


def load_rows(param: nn.Parameter, rows: torch.Tensor | None) -> None:
    """Give `param` a loader that copies rows `rows` (None: all) of the checkpoint tensor, read
    as rows of the parameter's trailing shape (a [1, 1, heads, 1] tensor as [heads])."""
    def loader(p: nn.Parameter, loaded: torch.Tensor) -> None:
        if rows is not None:
            loaded = loaded.reshape(-1, *p.shape[1:]).index_select(0, rows)
        p.data.copy_(loaded.reshape(p.shape))
    param.weight_loader = loader


def sharded_param(size: int, fill: float, ctx: BuildContext, *trailing: int,
                  dtype: torch.dtype | None = None) -> nn.Parameter:
    """A per-head (or per-channel) parameter [size / tp, *trailing]: this rank's slice, in
    `dtype` (default the model's)."""
    rows = shard_rows([(size, True)], ctx.tp_rank, ctx.tp_size, "per-head parameters")
    param = nn.Parameter(torch.full((rows.numel(), *trailing), fill, dtype=dtype or ctx.dtype),
                         requires_grad=False)
    load_rows(param, rows if ctx.tp_size > 1 else None)
    return param


class ShardedColumnLinear(LinearBase):
    """A column-parallel projection whose output is the concatenation of `shards`, each a list
    of parts: a checkpoint loads one shard at a time (`shard_id`, as a merged column layer's)
    or, with one shard, the whole output at once. Output rows are this rank's rows of every
    part, in order."""

    def __init__(self, input_size: int, shards: list[list[Part]], bias: bool,
                 ctx: BuildContext, prefix: str = "") -> None:
        self.shard_rows = [shard_rows(parts, ctx.tp_rank, ctx.tp_size, prefix)
                           for parts in shards]
        if len(shards) > 1:  # a merged layer's checkpoint shards, as quantized loaders count them
            self.output_sizes = [rows.numel() for rows in self.shard_rows]
        output = sum(rows.numel() for rows in self.shard_rows)
        super().__init__(input_size, output, bias, ctx, prefix, None)
        if ctx.tp_size > 1 and getattr(self.method, "custom_loader", False):
            raise ValueError(f"{prefix}: tensor parallel is not supported for this "
                             "quantization method's recurrent-layer projections")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if getattr(self.method, "custom_loader", False) and param is not self.bias:
            return self.method.load_weight(self, param, loaded, shard_id)
        index = 0 if shard_id is None else shard_id
        offset = sum(rows.numel() for rows in self.shard_rows[:index])
        rows = self.shard_rows[index]
        param.data.narrow(0, offset, rows.numel()).copy_(loaded.index_select(0, rows))
