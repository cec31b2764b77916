"""The quantization interface: how a linear layer holds and applies its weights.

A linear layer owns a `LinearMethod`. At build time the method creates the layer's parameters
(shapes per tensor-parallel shard); the loader fills them; after loading the method may repack
them for its kernel; every forward pass calls `apply`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

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
    """A quantization method as configured for one model (from flags or the checkpoint).

    `fast_kernel_platforms` names the platforms whose plugin answers the
    `runtime_quantization_kernel` hook with a fast kernel for this method; everywhere else the
    method runs its portable torch reference kernel (`reference_kernel()`). The engine sets
    `kernel` once, before the model is built (`runtime.quantization.registry.build_quant_config`).
    `kernel_method` is the method name the hook is asked with: a method that repacks its
    checkpoint into another method's layout (GPTQ and AWQ into int4) takes that method's kernels.
    `weights_from` says, for `runtime plugins`, which checkpoints the method reads.
    """

    name: str = ""
    kernel_method: str = ""
    weights_from: str = ""
    fast_kernel_platforms: tuple[str, ...] = ()
    kernel: Any = None

    @classmethod
    def from_options(cls, options: dict[str, str]) -> QuantizationConfig:
        """The method as asked for by `--quantization NAME[:key=value,...]`."""
        if options:
            raise ValueError(f"quantization {cls.name!r} takes no options, got {options}")
        return cls()

    @classmethod
    def from_checkpoint(cls, config: dict) -> QuantizationConfig:
        """The method as described by a checkpoint's `quantization_config`."""
        raise ValueError(f"quantization {cls.name!r} cannot be read from a checkpoint")

    def kernel_params(self) -> dict:
        """What the `runtime_quantization_kernel` hook receives as `params`."""
        return {}

    def reference_kernel(self) -> Any:
        """The portable torch kernel, used when no platform plugin supplies one."""
        return None

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer named `prefix` (e.g. "model.layers.0.mlp.down_proj")."""


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype.

    `prepare`, when given, is a platform's dense kernel (the "linear" custom op): called once
    with the loaded weight, it returns the function that computes the layer from then on.
    """

    name = "unquantized"

    def __init__(self, prepare: Callable[[torch.Tensor], Callable] | None = None) -> None:
        self.prepare = prepare

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                    requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.dense = self.prepare(layer.weight) if self.prepare is not None else None

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        dense = getattr(layer, "dense", None)
        return dense(x, bias) if dense is not None else F.linear(x, layer.weight, bias)
