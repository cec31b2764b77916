"""Kimi Linear (`KimiLinearForCausalLM`): Kimi delta attention layers
(runtime.layers.kimi_delta_attention) and multi-head latent attention without rotary
embeddings (DeepSeek-V3's MLA on the latent cache; the shared key part is not rotated), each
followed by a dense MLP (the first layers, `mlp_layer_types`) or DeepSeek-V3's grouped
sigmoid routing with its correction bias and shared experts on the fused MoE op.

Checkpoint names as the checkpoints' (transformers saves them so): `self_attn` (MLA or KDA by
`layer_types`), `block_sparse_moe` (read as `mlp`) with `gate` (`weight`,
`e_score_correction_bias`), `experts.{j}.w1/w2/w3` and `shared_experts`; the dense MLPs are
named `block_sparse_moe` too.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.kimi_delta_attention import KimiDeltaAttention
from runtime.layers.layernorm import RMSNorm
from runtime.models.deepseek_v3 import DeepseekV3Attention, grouped_topk
from runtime.models.llama import LlamaMLP, LlamaModel
from runtime.models.moe import MoeForCausalLM

_CONV = re.compile(r"(.*\.self_attn)\.([qkv])_conv1d\.weight$")


class KimiMLAAttention(DeepseekV3Attention):
    """MLA with no rotation (NoPE): the rope part of the queries and the shared key go to the
    attention as they are."""

    def rotate(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return q_pe, k_pe


class KimiRouter(nn.Module):
    """The router's weight and correction bias, in float32 as transformers keeps them."""

    def __init__(self, config) -> None:
        super().__init__()
        experts = config.num_local_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class KimiLinearMoE(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        if config.num_local_experts % config.n_group:
            raise ValueError(f"Kimi Linear: {config.num_local_experts} experts are not "
                             f"divisible by n_group {config.n_group}")
        self.config = config
        self.gate = KimiRouter(config)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size, False, ctx)
        self.shared_experts = LlamaMLP(config, ctx, f"{prefix}.shared_experts",
                                       config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        routed = grouped_topk(self.gate(x), self.gate.e_score_correction_bias, c.n_group,
                              c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
                              c.routed_scaling_factor)
        return self.experts.run_routed(x, *routed) + self.shared_experts(x)


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn = (KimiDeltaAttention(config, ctx, f"{prefix}.self_attn") if self.is_linear
                          else KimiMLAAttention(config, layer_idx, ctx, f"{prefix}.self_attn"))
        self.mlp = (LlamaMLP(config, ctx, f"{prefix}.mlp")
                    if config.mlp_layer_types[layer_idx] == "dense"
                    else KimiLinearMoE(config, ctx, f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden) if self.is_linear else self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class KimiLinearModel(LlamaModel):
    layer_cls = KimiLinearDecoderLayer


class KimiLinearForCausalLM(MoeForCausalLM):
    model_cls = KimiLinearModel
    is_hybrid = True
    supports_prompt_embeds = False  # not tested with the recurrent state: refused for now
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        modules = dict(self.named_modules())

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                conv = _CONV.match(name)
                if conv is None:
                    yield name, tensor
                    continue
                if not self.pp.owns(name, self.config.num_hidden_layers):
                    continue  # another pipeline stage's
                modules[conv.group(1)].load_conv(conv.group(2), tensor)
                loaded.add(f"{conv.group(1)}.conv1d.weight")
        return super().load_weights(others()) | loaded
