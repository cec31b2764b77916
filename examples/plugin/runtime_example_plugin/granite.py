"""IBM Granite (3.x): the Llama architecture with four multipliers from its config.

- embeddings are scaled by `embedding_multiplier`;
- attention scores are scaled by `attention_multiplier` instead of 1/sqrt(head_size);
- each block's attention and MLP outputs are scaled by `residual_multiplier` before the residual add;
- logits are divided by `logits_scaling`.

Models build on the engine's layers (`runtime.models`, `runtime.layers`): this module is imported
only when a Granite checkpoint is loaded.
"""
from __future__ import annotations

import torch

from runtime.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                  LlamaModel)


class GraniteAttention(LlamaAttention):
    def __init__(self, config, layer_idx, ctx, prefix) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.attn.impl.scale = config.attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, config, layer_idx, ctx, prefix) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.embedding_multiplier = config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
