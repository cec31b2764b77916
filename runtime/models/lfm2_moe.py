"""LFM2-MoE (`Lfm2MoeForCausalLM`): LFM2's short convolutions and attention
(runtime.models.lfm2) with a mixture of experts in place of the MLP after the first
`num_dense_layers` layers.

Its router scores each expert by sigmoid(logit); with `use_expert_bias` the top-k are chosen
by score plus the checkpoint's `expert_bias` and weighted by the unbiased score. The weights
are renormalised (`norm_topk_prob`, with transformers' 1e-6 in the sum) and scaled by
`routed_scaling_factor`. The experts run on the fused MoE op, split under tensor and expert
parallel as Qwen3-MoE's are; pipeline stages split the layers as LFM2's do.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import ReplicatedLinear
from runtime.models.lfm2 import (CHECKPOINT_RENAMES, Lfm2DecoderLayer, Lfm2ForCausalLM,
                                 Lfm2Model)
from runtime.models.llama import LlamaMLP
from runtime.models.moe import MoeForCausalLM


class Lfm2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, False, ctx,
                                     f"{prefix}.gate")
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size,
                                config.moe_intermediate_size, False, ctx)
        self.expert_bias = (nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                         requires_grad=False)
                            if config.use_expert_bias else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        scores = self.gate(x).float().sigmoid()
        if self.expert_bias is None:
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_routed(x, *self.route(x))


class Lfm2MoeDecoderLayer(Lfm2DecoderLayer):
    def build_feed_forward(self, config, layer_idx: int, ctx: BuildContext,
                           prefix: str) -> nn.Module:
        if layer_idx < config.num_dense_layers:
            return LlamaMLP(config, ctx, prefix, config.intermediate_size)
        return Lfm2MoeSparseMoeBlock(config, ctx, prefix)


class Lfm2MoeModel(Lfm2Model):
    layer_cls = Lfm2MoeDecoderLayer


class Lfm2MoeForCausalLM(MoeForCausalLM):
    model_cls = Lfm2MoeModel
    is_hybrid = True
    supports_prompt_embeds = False  # its model embeds the token ids itself
    checkpoint_renames = CHECKPOINT_RENAMES
    forward = Lfm2ForCausalLM.forward
