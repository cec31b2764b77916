"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] on its last dimension; returns silu(gate) * up."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.op = ctx.custom_op("silu_and_mul") or silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)
