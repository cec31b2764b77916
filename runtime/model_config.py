"""Facts about the model that the engine needs, read once from its Hugging Face config."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# `layer_types` entries of recurrent layers (hybrid models), which keep no KV
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv")
# and of layers without a token mixer (Nemotron-H's MLP and MoE layers), which keep none either
NO_KV_LAYER_TYPES = RECURRENT_LAYER_TYPES + ("mlp", "moe")


@dataclass(frozen=True)
class ModelChoice:
    """The implementation chosen for a model (runtime.models.registry.choose_model), and why."""

    architecture: str
    impl: str  # "native" or "transformers"
    model_class: type
    reason: str


def attention_heads(text_config: Any, layer_idx: int | None = None) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a Hugging Face text config: the one place they are
    derived, for `ModelConfig` and for the models' attention layers alike. A heterogeneous
    config (Gemma 4: global layers have `global_head_dim` and their own KV heads) answers per
    layer `layer_idx`, and without one for its widest layer."""
    if getattr(text_config, "is_heterogeneous", False):
        if layer_idx is None:
            return max((attention_heads(text_config, i)
                        for i in range(text_config.num_hidden_layers)),
                       key=lambda heads: heads[1] * heads[2])
        text_config = text_config.per_layer_config[layer_idx]
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_size = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    return num_heads, num_kv_heads, head_size


def mla_latent_size(text_config: Any) -> int | None:
    """Per-token width of a multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) layer's
    KV cache, `kv_lora_rank + qk_rope_head_dim`, or None for a model without MLA."""
    rank = getattr(text_config, "kv_lora_rank", None)
    return None if rank is None else rank + text_config.qk_rope_head_dim


@dataclass
class ModelConfig:
    hf_config: object
    architecture: str
    dtype: torch.dtype | None  # None until the platform is known (runtime.model_spec)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    sliding_window: int | None
    # per layer: "full_attention", "sliding_attention", or a recurrent layer's type
    layer_types: tuple[str, ...]
    choice: ModelChoice  # the implementation that runs it (native or transformers), and why
    # whether its attention has sinks (gpt-oss), as its model class declares
    attention_sinks: bool = False
    # "mla": each layer caches one latent vector of `head_size` per token (num_kv_heads 1,
    # the same on every tensor-parallel rank), not K and V per KV head
    attention_kind: str = "mha"
    # whether an image's tokens attend to each other both ways (Gemma 3), as its model class
    # declares: the backend must apply `mm_prefix_ranges`, and a step takes an image whole
    mm_prefix_lm: bool = False

    @classmethod
    def from_hf(cls, hf_config, choice: ModelChoice, dtype: torch.dtype | None,
                max_model_len: int | None, num_ranks: int = 1) -> "ModelConfig":
        """`choice` is the implementation that will run it; `num_ranks`, the tensor x pipeline
        ranks that will run it, is checked against what that one allows."""
        if choice.impl == "transformers" and num_ranks > 1:
            raise ValueError(f"{choice.architecture} runs through the transformers fallback, "
                             f"which runs on one rank only: tensor and pipeline parallel need "
                             f"a native model class")
        logger.info("model %s: %s implementation (%s)", choice.architecture, choice.impl,
                    choice.reason)
        text = hf_config.get_text_config()
        # a model of recurrent layers only (Mamba 2) has no attention heads
        num_heads, num_kv_heads, head_size = (attention_heads(text)
                                              if hasattr(text, "num_attention_heads")
                                              else (0, 0, 0))
        latent = mla_latent_size(text)
        if latent is not None:
            num_kv_heads, head_size = 1, latent
        limit = getattr(text, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if layer_types is None:
            slides = window is not None and getattr(text, "use_sliding_window", True) is not False
            layer_types = ["sliding_attention" if slides else "full_attention"] \
                * text.num_hidden_layers
        return cls(
            hf_config=hf_config,
            architecture=choice.architecture,
            dtype=dtype,
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            max_model_len=max_model_len or limit,
            sliding_window=window,
            layer_types=tuple(layer_types),
            choice=choice,
            attention_sinks=getattr(choice.model_class, "attention_sinks", False),
            attention_kind="mha" if latent is None else "mla",
            mm_prefix_lm=getattr(choice.model_class, "mm_prefix_lm", False),
        )

    @property
    def is_hybrid(self) -> bool:
        """Recurrent layers beside attention: their state lives in state slots, not KV."""
        return bool(getattr(self.choice.model_class, "is_hybrid", False))

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
        """Over the layers that keep a cache (not Gemma 4's KV-shared ones, nor a hybrid's
        recurrent or MLP-only layers), each its own shape; an MLA layer keeps one latent per
        token."""
        itemsize = torch.empty(0, dtype=kv_dtype).element_size()
        if self.attention_kind == "mla":
            cached = sum(kind not in NO_KV_LAYER_TYPES for kind in self.layer_types)
            return cached * block_size * self.head_size * itemsize
        text = self.hf_config.get_text_config()
        sharing = getattr(text, "kv_sharing_modes", None) or [None] * self.num_layers
        cached = [i for i in range(self.num_layers)
                  if sharing[i] != "reuse" and self.layer_types[i] not in NO_KV_LAYER_TYPES]
        width = sum(max(1, kv_heads // tp_size) * head_size
                    for _, kv_heads, head_size in (attention_heads(text, i) for i in cached))
        return 2 * block_size * width * itemsize
