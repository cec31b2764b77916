"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.plugins.ops import silu_and_mul


class SiluAndMul(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.op = ctx.custom_op("silu_and_mul") or silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)
