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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] on its last dimension; returns gelu_tanh(gate) * up (Gemma)."""
    gate, up = x.chunk(2, -1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.op = ctx.custom_op("gelu_tanh_and_mul") or gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


# config.json's activation name -> the gated activation of an MLP that uses it
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
