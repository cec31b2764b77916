"""Linear layers whose checkpoint tensors are quantized already (FP8, GPTQ, AWQ, MXFP4, NVFP4).

While loading, the layer holds one empty placeholder parameter per checkpoint tensor name (so
that the model's name mapping and the loaded-weights check see them); the layer's weight loader
hands every tensor to `load_weight`, which keeps it per shard (q/k/v, gate/up). After loading,
each shard is converted to the method's unpacked form (`convert`), cut to this tensor-parallel
rank's slice (the same rows or columns the float weight loaders take), and `pack` registers the
layer's real parameters from the slices in output order.
"""
from __future__ import annotations

import re
from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from runtime.quantization.base import LinearMethod

SHARD_ORDER = {"q": 0, "k": 1, "v": 2}
# Our fused layers and the checkpoint projections they are made of.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def checkpoint_names(prefix: str) -> list[str]:
    """"model.layers.0.self_attn.qkv_proj" -> the q/k/v names the checkpoint uses."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_PARTS.get(last, (last,))
    return [f"{head}.{p}" if head else p for p in parts]


def is_ignored(prefix: str, patterns: list[str]) -> bool:
    """Whether a checkpoint's ignore list (names, or "re:" regexes as compressed-tensors writes
    them) leaves the layer `prefix` unquantized. A fused layer must be all in or all out."""
    def hit(name: str) -> bool:
        for p in patterns:
            if p.startswith("re:"):
                if re.match(p[3:], name):
                    return True
            elif name == p or name.endswith("." + p) or name.startswith(p + "."):
                return True
        return False

    hits = [hit(n) for n in checkpoint_names(prefix)]
    if any(hits) and not all(hits):
        raise ValueError(f"the checkpoint quantizes only some of the projections fused into "
                         f"{prefix}; all or none of {checkpoint_names(prefix)} must be ignored")
    return all(hits)


class CheckpointLinearMethod(LinearMethod):
    """Collects a layer's quantized checkpoint tensors per shard; `convert` and `pack` them."""

    custom_loader = True

    def __init__(self, tensor_names: tuple[str, ...]) -> None:
        self.tensor_names = tensor_names
        self.parts: dict = {}

    def create_weights(self, layer, input_size, output_size, params_dtype):
        for name in self.tensor_names:
            setattr(layer, name, param(torch.empty(0, dtype=torch.uint8)))
        self.input_size, self.output_size, self.dtype = input_size, output_size, params_dtype

    def load_weight(self, layer, param, loaded, shard_id=None) -> None:
        name = next(n for n in self.tensor_names if getattr(layer, n) is param)
        self.parts.setdefault(shard_id, {})[name] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        expected = ({"q", "k", "v"} if hasattr(layer, "num_kv_heads") else
                    set(range(len(layer.output_sizes))) if hasattr(layer, "output_sizes")
                    else {None})
        if set(self.parts) != expected:
            raise ValueError(f"{self.name}: expected checkpoint shards {sorted(map(str, expected))}"
                             f" of a layer, got {sorted(map(str, self.parts))}")
        ids = sorted(self.parts, key=lambda k: SHARD_ORDER.get(k, k or 0))
        for i in ids:
            lacking = set(self.tensor_names) - set(self.parts[i])
            if lacking:
                raise ValueError(f"{self.name}: checkpoint shard {i} of a layer lacks "
                                 f"{sorted(lacking)}")
        for name in self.tensor_names:
            delattr(layer, name)
        parts, self.parts = self.parts, {}
        self.pack(layer, [tp_slice(layer, i, self.convert(parts[i])) for i in ids])

    @abstractmethod
    def convert(self, tensors: dict[str, torch.Tensor]) -> Any:
        """One checkpoint shard's tensors -> the method's unpacked weight (with `rows`/`cols`)."""

    @abstractmethod
    def pack(self, layer: nn.Module, weights: list) -> None:
        """Register the layer's parameters from its rank's shard weights (in output order)."""

    def check_rows(self, rows: int, cols: int) -> None:
        if rows != self.output_size or cols != self.input_size:
            raise ValueError(f"{self.name} weights of [{rows}, {cols}] do not fit a layer of "
                             f"[{self.output_size}, {self.input_size}]")


def tp_slice(layer: nn.Module, shard_id, w):
    """This rank's part of one shard's weight: the rows (column-parallel) or input columns
    (row-parallel) that `runtime.layers.linear`'s loaders take from a float weight."""
    tp, rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if tp == 1:
        return w
    if layer.tp_dim == 1:
        return w.cols(rank * layer.input_size, layer.input_size)
    if shard_id in ("q", "k", "v"):
        heads = layer.num_heads if shard_id == "q" else layer.num_kv_heads
        size = heads * layer.head_size
        return w.rows((rank if shard_id == "q" else rank // layer.kv_replicas) * size, size)
    size = w.out_features // tp
    return w.rows(rank * size, size)
