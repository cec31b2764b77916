"""Facts about the model that the engine needs, read once from its Hugging Face config."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runtime.models.registry import ModelChoice, choose_model

logger = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    hf_config: object
    architecture: str
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    sliding_window: int | None
    choice: ModelChoice  # the implementation that runs it (native or transformers), and why

    @classmethod
    def from_hf(cls, hf_config, dtype: torch.dtype, max_model_len: int | None,
                model_impl: str = "auto", num_ranks: int = 1) -> "ModelConfig":
        """`model_impl` picks the implementation (runtime.models.registry); `num_ranks`, the
        tensor x pipeline ranks that will run it, is checked against what that one allows.
        The architecture is checked first, so an unsupported config fails with one line that
        names what is supported, whatever fields it lacks."""
        choice = choose_model(getattr(hf_config, "architectures", None), model_impl, hf_config)
        if choice.impl == "transformers" and num_ranks > 1:
            raise ValueError(f"{choice.architecture} runs through the transformers fallback, "
                             f"which runs on one rank only: tensor and pipeline parallel need "
                             f"a native model class")
        logger.info("model %s: %s implementation (%s)", choice.architecture, choice.impl,
                    choice.reason)
        text = hf_config.get_text_config()
        num_heads = text.num_attention_heads
        limit = getattr(text, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return cls(
            hf_config=hf_config,
            architecture=choice.architecture,
            dtype=dtype,
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_size=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            max_model_len=max_model_len or limit,
            sliding_window=getattr(text, "sliding_window", None),
            choice=choice,
        )

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
        heads = max(1, self.num_kv_heads // tp_size)
        itemsize = torch.empty(0, dtype=kv_dtype).element_size()
        return 2 * self.num_layers * block_size * heads * self.head_size * itemsize
