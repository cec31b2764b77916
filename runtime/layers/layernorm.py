"""RMSNorm, optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The portable op: normalise in float32, scale in the input dtype (as HF Llama does)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The portable fused op: (rms_norm(x + residual), x + residual)."""
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.op = ctx.custom_op("rms_norm") or rms_norm
        self.add_op = ctx.custom_op("add_rms_norm")  # each op is replaced on its own

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.op(x, self.weight, self.eps)
        if self.add_op is not None:
            return self.add_op(x, residual, self.weight, self.eps)
        x = x + residual
        return self.op(x, self.weight, self.eps), x
