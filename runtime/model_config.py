"""Facts about the model that the engine needs, read once from its Hugging Face config."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelChoice:
    """The implementation chosen for a model (runtime.models.registry.choose_model), and why."""

    architecture: str
    impl: str  # "native" or "transformers"
    model_class: type
    reason: str


def attention_heads(text_config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a Hugging Face text config: the one place they are
    derived, for `ModelConfig` and for the models' attention layers alike."""
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
    layer_types: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"
    choice: ModelChoice  # the implementation that runs it (native or transformers), and why
    # "mla": each layer caches one latent vector of `head_size` per token (num_kv_heads 1,
    # the same on every tensor-parallel rank), not K and V per KV head
    attention_kind: str = "mha"

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
        num_heads, num_kv_heads, head_size = attention_heads(text)
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
            attention_kind="mha" if latent is None else "mla",
        )

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
        itemsize = torch.empty(0, dtype=kv_dtype).element_size()
        if self.attention_kind == "mla":
            return self.num_layers * block_size * self.head_size * itemsize
        heads = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * block_size * heads * self.head_size * itemsize
