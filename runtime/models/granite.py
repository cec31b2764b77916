"""IBM Granite 3.x (dense and MoE): the Llama layers with the four muP multipliers of its
config.

- embeddings are scaled by `embedding_multiplier`;
- attention scores are scaled by `attention_multiplier` instead of 1/sqrt(head_size);
- each block's attention and MLP outputs are scaled by `residual_multiplier` before the
  residual add;
- logits are divided by `logits_scaling`.

GraniteMoe replaces the MLP with top-k experts (softmax over the chosen experts' logits) whose
checkpoint stacks them as `block_sparse_moe.input_linear` [E, 2I, H] (gate | up) and
`output_linear` [E, H, I], with the router at `router.layer`.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.models.moe import MoeForCausalLM, SparseMoeBlock


class GraniteAttention(LlamaAttention):
    def attention_scale(self, config) -> float:
        return config.attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
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

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.embedding_multiplier = config.embedding_multiplier

    def scale_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        return SparseMoeBlock(config, ctx, prefix, config.num_local_experts,
                              config.num_experts_per_tok, config.intermediate_size, True)


class GraniteMoeModel(GraniteModel):
    layer_cls = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(MoeForCausalLM):
    model_cls = GraniteMoeModel
    checkpoint_renames = {".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
                          ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
                          ".block_sparse_moe.router.layer.": ".mlp.gate.",
                          ".block_sparse_moe.router.": ".mlp.gate.",
                          ".block_sparse_moe.": ".mlp."}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
