"""The CPU platform's fused layer ops (`csrc/layer_ops.cpp`), with the portable ones as fallback
for shapes the kernels do not take (a last dimension that is not a multiple of 8, strided
views such as Qwen3's per-head q/k norms)."""
from __future__ import annotations

import torch

from runtime.layers.activation import silu_and_mul as portable_silu_and_mul
from runtime.layers.layernorm import add_rms_norm as portable_add_rms_norm
from runtime.layers.layernorm import rms_norm as portable_rms_norm


def _fits(x: torch.Tensor, multiple: int) -> bool:
    return x.is_contiguous() and x.size(-1) % multiple == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fits(x, 8):
        return portable_rms_norm(x, weight, eps)
    return torch.ops.runtime_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_fits(x, 8) and residual.is_contiguous()):
        return portable_add_rms_norm(x, residual, weight, eps)
    return torch.ops.runtime_cpu.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _fits(x, 16):
        return portable_silu_and_mul(x)
    return torch.ops.runtime_cpu.silu_and_mul(x)


OPS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_and_mul": silu_and_mul}
