"""Building a model on a worker's device from the platform's answers: the one path the target
model and a draft model both load through."""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.model_loader.source import ModelSource, iterate_weights
from runtime.plugins.interfaces import ModelInfo


class ModelShape(Protocol):
    """What `model_info` reads of a `runtime.model_config.ModelConfig`."""

    architecture: str
    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None
    attention_sinks: bool
    mm_prefix_lm: bool
    attention_kind: str


def model_info(mc: ModelShape, kv_cache_dtype: torch.dtype, block_size: int,
               enforce_eager: bool = False, pooling: bool = False) -> ModelInfo:
    """What the hooks learn about a model: its shapes, dtypes and how it runs."""
    return ModelInfo(architecture=mc.architecture, dtype=mc.dtype, kv_cache_dtype=kv_cache_dtype,
                     head_size=mc.head_size, num_heads=mc.num_heads,
                     num_kv_heads=mc.num_kv_heads, sliding_window=mc.sliding_window,
                     block_size=block_size, enforce_eager=enforce_eager, pooling=pooling,
                     attention_sinks=mc.attention_sinks, attention_kind=mc.attention_kind,
                     mm_prefix_lm=mc.mm_prefix_lm)


def build_model(model_cls: type, hf_config: Any, ctx: BuildContext, source: ModelSource,
                raw_gguf: bool = False) -> nn.Module:
    """Build a model on `ctx.device`, load its weights from `source` and let each layer's
    method process them (packing for the platform's `linear` or quantization kernel)."""
    with torch.device(ctx.device):
        model = model_cls(hf_config, ctx)
    loaded = model.load_weights(iterate_weights(source, hf_config, ctx.dtype, raw_gguf=raw_gguf))
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks weights: {sorted(missing)[:8]}")
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()
