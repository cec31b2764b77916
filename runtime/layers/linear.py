"""Linear layers that can be sharded over tensor-parallel ranks and quantized.

Column-parallel layers split the output dimension (no communication); row-parallel layers split
the input dimension and all-reduce their partial sums. Each parameter carries a `weight_loader`
that copies this rank's slice of a full checkpoint tensor into it.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """`tp_dim` is the weight dimension split across ranks: 0 (output), 1 (input) or None.

    A method with `custom_loader = True` receives the layer's (non-bias) checkpoint tensors
    itself, through `method.load_weight(layer, param, loaded, shard_id=None)`.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: BuildContext,
                 prefix: str, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = ctx.tp_rank if tp_dim is not None else 0
        self.tp_size = ctx.tp_size if tp_dim is not None else 1
        self.input_size = input_size
        self.output_size = output_size
        self.method = ctx.linear_method(prefix)
        self.method.create_weights(self, input_size, output_size, ctx.dtype)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if getattr(self.method, "custom_loader", False) and param is not self.bias:
            return self.method.load_weight(self, param, loaded)
        if self.tp_dim is not None and self.tp_size > 1 and \
                not (param is self.bias and self.tp_dim == 1):
            dim = 0 if loaded.dim() == 1 else self.tp_dim
            shard = param.size(dim)
            loaded = loaded.narrow(dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: BuildContext,
                 prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, ctx, prefix, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: BuildContext,
                 prefix: str = "") -> None:
        super().__init__(input_size, divide(output_size, ctx.tp_size), bias, ctx, prefix, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: BuildContext,
                 prefix: str = "") -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, ctx, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        if getattr(self.method, "custom_loader", False) and param is not self.bias:
            return self.method.load_weight(self, param, loaded, shard_id)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul; KV heads are split (or replicated when
    there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool, ctx: BuildContext, prefix: str = "") -> None:
        tp = ctx.tp_size
        self.head_size = head_size
        self.num_heads = divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        output_size = (num_heads + 2 * self.num_kv_heads * tp) * head_size
        super().__init__(hidden_size, output_size, bias, ctx, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        if getattr(self.method, "custom_loader", False) and param is not self.bias:
            return self.method.load_weight(self, param, loaded, shard_id)
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        offset, size, rank = {"q": (0, q_size, self.tp_rank),
                              "k": (q_size, kv_size, self.tp_rank // self.kv_replicas),
                              "v": (q_size + kv_size, kv_size,
                                    self.tp_rank // self.kv_replicas)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: BuildContext,
                 prefix: str = "") -> None:
        super().__init__(divide(input_size, ctx.tp_size), output_size, bias, ctx, prefix, 1)
        self.tp_group = ctx.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = self.method.apply(self, x, bias)
        if self.tp_size > 1:
            y = self.tp_group.all_reduce(y)
        return y
