"""RMSNorm, optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.plugins.ops import compose_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.op = ctx.custom_op("rms_norm") or rms_norm
        # a plugin's fused op, else the add composed with whichever rms_norm was registered
        self.add_op = ctx.custom_op("add_rms_norm") or compose_add_rms_norm(self.op)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.op(x, self.weight, self.eps)
        return self.add_op(x, residual, self.weight, self.eps)
