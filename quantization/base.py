"""The quantization interface: how a linear layer holds and applies its weights.

A linear layer owns a `LinearMethod`. At build time the method creates the layer's parameters
(shapes per tensor-parallel shard); the loader fills them; after loading the method may repack
them for its kernel; every forward pass calls `apply`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """Weight layout and matmul of one linear layer."""

    name: str = ""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the layer's parameters for a local shard of [output_size, input_size]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded weights for the kernel (called once, after every weight is loaded)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W.T + bias for this layer's shard."""


class QuantizationConfig(ABC):
    """A quantization method as configured for one model (from flags or the checkpoint)."""

    name: str = ""

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer named `prefix` (e.g. "model.layers.0.mlp.down_proj")."""


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                    requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
