"""A linear layer with per-token LoRA: the base layer's output plus, for each token with an
adapter, expand(shrink(x, A[slot]), B[slot]); the adapters sit in `max_loras` fixed slots."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from runtime.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)
from runtime.lora.adapter import LoRAWeights
from runtime.plugins.lora_ops import LoRABatch


class StepLoRA:
    """The step's token-to-slot map, shared by every LoRA layer (None: no token has one)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def slice_sizes(base: LinearBase) -> list[int]:
    """Output sizes of the fused projections a layer holds (q, k, v / gate, up / one)."""
    if isinstance(base, QKVParallelLinear):
        q, kv = base.num_heads * base.head_size, base.num_kv_heads * base.head_size
        return [q, kv, kv]
    if isinstance(base, MergedColumnParallelLinear):
        return [size // base.tp_size for size in base.output_sizes]
    return [base.output_size]


def _rank_slice(base: LinearBase, index: int, w: LoRAWeights) -> LoRAWeights:
    """This tensor-parallel rank's share of one slice's weights, cut as the base layer's: B's
    output rows for a column-parallel layer (KV heads shared by `kv_replicas` ranks), A's input
    columns for a row-parallel one."""
    if base.tp_size == 1:
        return w
    if isinstance(base, RowParallelLinear):
        shard = w.a.size(1) // base.tp_size
        return LoRAWeights(w.a.narrow(1, base.tp_rank * shard, shard), w.b)
    rank = base.tp_rank
    if isinstance(base, QKVParallelLinear) and index > 0:
        rank //= base.kv_replicas
    size = slice_sizes(base)[index]
    return LoRAWeights(w.a, w.b.narrow(0, rank * size, size))


class LoRALinear(nn.Module):
    """With tensor parallelism, a row-parallel layer's shrink sums partial products over the
    ranks (all-reduce), then every rank adds the same delta to the all-reduced output."""

    def __init__(self, base: LinearBase, max_loras: int, max_rank: int, step: StepLoRA,
                 shrink: Callable, expand: Callable, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.shrink, self.expand = shrink, expand
        sizes = slice_sizes(base)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        device = next(base.parameters()).device
        self.register_buffer("a", torch.zeros(max_loras, len(sizes), max_rank, base.input_size,
                                              dtype=dtype, device=device))
        # B is [slots, out, rank] stored as [slots, rank, out]: a kernel's expand then reads
        # each rank's row of output columns contiguously
        self.register_buffer("b", torch.zeros(max_loras, max_rank, base.output_size, dtype=dtype,
                                              device=device).transpose(1, 2))

    def set_slot(self, slot: int, slices: dict[int, LoRAWeights]) -> None:
        """Put one adapter's weights for this layer's slices in `slot` (absent slices: zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, w in slices.items():
            w = _rank_slice(self.base, index, w)
            rank = w.a.size(0)
            self.a[slot, index, :rank].copy_(w.a)
            self.b[slot, self.offsets[index]:self.offsets[index + 1], :rank].copy_(w.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.step.batch
        if batch is None:
            return y
        flat_x, flat_y = x.reshape(-1, x.size(-1)), y.reshape(-1, y.size(-1))
        buf = self.shrink(flat_x, self.a, batch)
        if isinstance(self.base, RowParallelLinear) and self.base.tp_size > 1:
            buf = self.base.tp_group.all_reduce(buf)
        return self.expand(flat_y, buf, self.b, batch, self.offsets).view_as(y)
