"""Falcon-H1: in every layer a Mamba 2 mixer and attention side by side on the same normed
input, their outputs added, then a gated MLP; muP multipliers scale the embeddings, the
mixer's input and projection parts, the attention's input, keys and output, the mixer's
output, the MLP's gate and output, and the logits. The mixer's gated norm is optional
(`mamba_rms_norm`: without it the scan's output is only gated) and may norm before gating
(`mamba_norm_before_gate`). Checkpoint names as transformers' (`mamba`, `self_attn`,
`feed_forward`, `model.final_layernorm`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.bamba import BambaForCausalLM
from runtime.models.granite import GraniteModel
from runtime.models.llama import LlamaAttention, LlamaMLP


class FalconH1Attention(LlamaAttention):
    def attention_scale(self, config) -> float:
        # the keys times key_multiplier: the same scores as the scale times it
        return self.head_size ** -0.5 * config.key_multiplier


class FalconH1MLP(LlamaMLP):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, ctx, prefix)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Falcon-H1: MLP activation {config.hidden_act!r} is not "
                             "supported (silu only)")
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        intermediate = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
        self.mamba = Mamba2Mixer(
            ctx, f"{prefix}.mamba", hidden_size=config.hidden_size,
            num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
            n_groups=config.mamba_n_groups, state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv, intermediate_size=intermediate,
            use_conv_bias=config.mamba_conv_bias, use_bias=config.mamba_proj_bias,
            eps=config.rms_norm_eps, chunk_size=config.mamba_chunk_size,
            time_step_limit=config.time_step_limit, norm=config.mamba_rms_norm,
            norm_before_gate=config.mamba_norm_before_gate,
            input_multiplier=config.ssm_in_multiplier,
            projection_multipliers=config.ssm_multipliers,
            out_proj_bias=config.projectors_bias)
        self.self_attn = FalconH1Attention(config, layer_idx, ctx, f"{prefix}.self_attn")
        self.feed_forward = FalconH1MLP(config, ctx, f"{prefix}.feed_forward")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.attention_in_multiplier = config.attention_in_multiplier
        self.attention_out_multiplier = config.attention_out_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixed = (self.mamba(hidden) * self.ssm_out_multiplier
                 + self.self_attn(positions, hidden * self.attention_in_multiplier)
                 * self.attention_out_multiplier)
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class FalconH1Model(GraniteModel):
    """Granite's embeddings times `embedding_multiplier`."""

    layer_cls = FalconH1DecoderLayer


class FalconH1ForCausalLM(BambaForCausalLM):
    """Bamba's loading (its final norm is `model.final_layernorm` too)."""

    model_cls = FalconH1Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.lm_head_multiplier
