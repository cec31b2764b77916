"""FP8 KV-cache scales stored in checkpoints, under the names vLLM reads, set on our layers.

A checkpoint quantized for an FP8 KV cache carries one K scale and one V scale per attention
layer, named after the layer's attention module (`model.layers.0.self_attn.k_scale`), the older
single `kv_scale`, or the projections' `output_scale` (compressed-tensors) and `k_proj.k_scale`
(ModelOpt). They are per-tensor scalars.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import Attention

# checkpoint name suffix -> the cache scales it sets
KV_SCALE_SUFFIXES = {
    ".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": ("k_scale", "v_scale"),
    ".k_proj.output_scale": ("k_scale",), ".v_proj.output_scale": ("v_scale",),
    ".k_proj.k_scale": ("k_scale",), ".v_proj.v_scale": ("v_scale",),
}


def kv_scale_suffix(name: str) -> str | None:
    """The KV-scale suffix `name` ends with, or None for any other tensor."""
    return max((s for s in KV_SCALE_SUFFIXES if name.endswith(s)), key=len, default=None)


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """When `name` is a KV-cache scale, set it on the attention layer under the module it names
    and return True; False for any other tensor."""
    suffix = kv_scale_suffix(name)
    if suffix is None:
        return False
    prefix = name[:-len(suffix)]
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        module = None
    layers = [m for m in module.modules() if isinstance(m, Attention)] if module else []
    if len(layers) != 1:
        raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale, but {prefix!r} is not "
                         f"one attention layer of {type(model).__name__}")
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r}: only per-tensor KV-cache scales are "
                         f"supported, got shape {tuple(tensor.shape)}")
    value = float(tensor.float())
    layers[0].impl.set_kv_scales(**dict.fromkeys(KV_SCALE_SUFFIXES[suffix], value))
    return True
