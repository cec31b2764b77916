"""Bamba: Mamba 2 mixers (`mamba`) and Llama attention with partial rotary embeddings
(`attn_layer_indices`), each followed by a gated MLP (`feed_forward`, behind
`pre_ff_layernorm`); the final norm is the checkpoint's `final_layernorm`."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class BambaDecoderLayer(nn.Module):
    """A Mamba mixer (`mamba`) or attention, then the feed-forward block; Jamba swaps in its
    own mixer, attention and MoE through `build_mixer`, `attention_cls` and
    `build_feed_forward`."""

    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.mamba = self.build_mixer(config, ctx, f"{prefix}.mamba")
        else:
            self.self_attn = self.attention_cls(config, layer_idx, ctx, f"{prefix}.self_attn")
        self.feed_forward = self.build_feed_forward(config, layer_idx, ctx,
                                                    f"{prefix}.feed_forward")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def build_mixer(self, config, ctx: BuildContext, prefix: str) -> nn.Module:
        return Mamba2Mixer.from_hybrid_config(config, ctx, prefix)

    def build_feed_forward(self, config, layer_idx: int, ctx: BuildContext, prefix: str
                           ) -> nn.Module:
        return LlamaMLP(config, ctx, prefix)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.mamba(hidden)
        else:
            hidden = self.self_attn(positions, hidden)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(LlamaModel):
    layer_cls = BambaDecoderLayer


class BambaForCausalLM(LlamaForCausalLM):
    model_cls = BambaModel
    is_hybrid = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.final_layernorm` is our `model.norm`."""
        return super().load_weights(
            (name.replace("model.final_layernorm.", "model.norm.", 1), tensor)
            for name, tensor in weights)
