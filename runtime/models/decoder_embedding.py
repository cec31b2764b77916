"""Decoder models as embedders (the Qwen3-Embedding layout): the native causal-LM class without
its LM head; the pooling runner takes the last token's hidden state."""
from __future__ import annotations

from typing import Iterable

import torch

from runtime.layers.build_context import BuildContext


def as_embedding_model(causal_lm_cls: type) -> type:
    """A subclass of a native `*ForCausalLM` (a Llama-family one) that keeps no LM head and
    loads checkpoints saved with or without the `model.` prefix (Qwen3-Embedding has none)."""

    class ForEmbedding(causal_lm_cls):
        encoder_only = False

        def __init__(self, config, ctx: BuildContext) -> None:
            super().__init__(config, ctx)
            self.lm_head = None

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
            return self.model(input_ids, positions)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            named = ((name if name.startswith("model.") else f"model.{name}", tensor)
                     for name, tensor in weights if not name.startswith("lm_head."))
            return super().load_weights(named)

    ForEmbedding.__name__ = ForEmbedding.__qualname__ = causal_lm_cls.__name__.replace(
        "ForCausalLM", "ForEmbedding")
    return ForEmbedding
