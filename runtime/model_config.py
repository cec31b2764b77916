"""Facts about the model that the engine needs, read once from its Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @classmethod
    def from_hf(cls, hf_config, dtype: torch.dtype, max_model_len: int | None) -> "ModelConfig":
        num_heads = hf_config.num_attention_heads
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        archs = getattr(hf_config, "architectures", None) or ["?"]
        return cls(
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_size=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            max_model_len=max_model_len or limit,
            sliding_window=getattr(hf_config, "sliding_window", None),
        )

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype, tp_size: int = 1) -> int:
        heads = max(1, self.num_kv_heads // tp_size)
        itemsize = torch.empty(0, dtype=kv_dtype).element_size()
        return 2 * self.num_layers * block_size * heads * self.head_size * itemsize
