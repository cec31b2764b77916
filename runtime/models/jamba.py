"""Jamba: Mamba 1 mixers with RMS-normalised dt, B and C, and attention without rotary
embeddings every `attn_layer_period` layers; the feed-forward block of every
`expert_layer_period`-th layer a top-k MoE (softmax router, top-k weights not renormalised),
else a gated MLP. The layer is Bamba's with these parts; the checkpoint keeps the experts
stacked (`feed_forward.experts.gate_up_proj`), its router is `feed_forward.router` and its
final norm `model.final_layernorm`."""
from __future__ import annotations

from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.mamba_mixer import MambaMixer
from runtime.models.bamba import BambaDecoderLayer
from runtime.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from runtime.models.moe import MoeForCausalLM, SparseMoeBlock


class NoRopeAttention(LlamaAttention):
    """Llama attention whose q and k are not rotated (Jamba, Nemotron-H)."""

    def uses_rope(self, config) -> bool:
        return False


class JambaDecoderLayer(BambaDecoderLayer):
    attention_cls = NoRopeAttention

    def build_mixer(self, config, ctx: BuildContext, prefix: str) -> nn.Module:
        return MambaMixer(ctx, prefix, hidden_size=config.hidden_size,
                          intermediate_size=config.mamba_expand * config.hidden_size,
                          state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
                          dt_rank=config.mamba_dt_rank, use_conv_bias=config.mamba_conv_bias,
                          use_bias=config.mamba_proj_bias, activation=config.hidden_act,
                          bcdt_norm_eps=config.rms_norm_eps)

    def build_feed_forward(self, config, layer_idx: int, ctx: BuildContext, prefix: str
                           ) -> nn.Module:
        num_experts = config.layers_num_experts[layer_idx]
        if num_experts == 1:
            return LlamaMLP(config, ctx, prefix)
        return SparseMoeBlock(config, ctx, prefix, num_experts, config.num_experts_per_tok,
                              config.intermediate_size, False)


class JambaModel(LlamaModel):
    layer_cls = JambaDecoderLayer


class JambaForCausalLM(MoeForCausalLM):
    model_cls = JambaModel
    is_hybrid = True
    checkpoint_renames = {".feed_forward.router.": ".feed_forward.gate.",
                          "model.final_layernorm.": "model.norm."}
