"""LFM2: short gated convolutions (`conv` layers) and attention with per-head q/k norms, each
followed by a SwiGLU MLP (`feed_forward` w1/w3/w2); the final norm is `embedding_norm`.

A short conv keeps only its conv state ([hidden, L - 1] per sequence) in the state cache:
y = C * conv(B * x), with B, C, x the three thirds of `in_proj`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.forward_context import get_forward_context
from runtime.distributed.pipeline import Intermediate
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.gated_delta_net import DepthwiseConvWeight
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import RowParallelLinear
from runtime.layers.recurrent_sharding import ShardedColumnLinear, shard_rows, split
from runtime.layers.recurrent_state import StatefulLayer, conv_states_at
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from runtime.plugins import recurrent_ops

# checkpoint name part -> ours
CHECKPOINT_RENAMES = {".self_attn.out_proj.": ".self_attn.o_proj.", ".q_layernorm.": ".q_norm.",
            ".k_layernorm.": ".k_norm.", ".feed_forward.w1.": ".feed_forward.gate_proj.",
            ".feed_forward.w3.": ".feed_forward.up_proj.",
            ".feed_forward.w2.": ".feed_forward.down_proj."}


class ShortConv(StatefulLayer):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        # channels split over the ranks: B, C and x each, the conv and out_proj's input with them
        hidden, tp = config.hidden_size, ctx.tp_size
        self.hidden = split(hidden, tp, "LFM2 short-conv channels")
        self.width, self.dtype = config.conv_L_cache, ctx.dtype
        channels = [(hidden, True)]
        self.in_proj = ShardedColumnLinear(hidden, [channels * 3], config.conv_bias, ctx,
                                           f"{prefix}.in_proj")
        self.conv = DepthwiseConvWeight(self.hidden, self.width, ctx.dtype, config.conv_bias,
                                        shard_rows(channels, ctx.tp_rank, tp) if tp > 1 else None)
        self.out_proj = RowParallelLinear(hidden, hidden, config.conv_bias, ctx,
                                          f"{prefix}.out_proj")
        self.conv_op = ctx.custom_op("causal_conv1d") or recurrent_ops.causal_conv1d
        self.conv_update_op = (ctx.custom_op("causal_conv1d_update")
                               or recurrent_ops.causal_conv1d_update)

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((self.hidden, self.width - 1), self.dtype)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        bx = B * x
        (state,) = self.states
        nd, slots = md.num_decode_tokens, md.state_indices
        out = torch.empty_like(bx)
        if nd:
            out[:nd] = self.conv_update_op(bx[:nd], state, self.conv.weight, self.conv.bias,
                                           None, slots[:nd])
            self.checkpoint_decodes(md)
        if nd < bx.size(0):
            rows, has = slots[nd:], md.has_initial_state[nd:]
            starts = md.query_start_loc[nd:] - nd
            initial = state[rows]
            out[nd:], final = self.conv_op(bx[nd:], self.conv.weight, self.conv.bias, starts,
                                           initial, has, None)
            state[rows] = final
            at, entries = self.prefill_checkpoints(md)
            if at is not None:
                self.store(0, entries, conv_states_at(bx[nd:], initial, has, starts, at))
        return self.out_proj(C * out)


class Lfm2Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__(config, layer_idx, ctx, prefix)
        self.qk_norm = True
        self.q_norm = RMSNorm(self.head_size, config.norm_eps, ctx)
        self.k_norm = RMSNorm(self.head_size, config.norm_eps, ctx)


def lfm2_intermediate_size(config) -> int:
    """The MLP width as transformers' `Lfm2MLP` derives it from the config."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
        size = config.block_multiple_of * -(-size // config.block_multiple_of)
    return size


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.is_conv = config.layer_types[layer_idx] == "conv"
        if self.is_conv:
            self.conv = ShortConv(config, ctx, f"{prefix}.conv")
        else:
            self.self_attn = Lfm2Attention(config, layer_idx, ctx, f"{prefix}.self_attn")
        self.feed_forward = self.build_feed_forward(config, layer_idx, ctx,
                                                    f"{prefix}.feed_forward")
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps, ctx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps, ctx)

    def build_feed_forward(self, config, layer_idx: int, ctx: BuildContext,
                           prefix: str) -> nn.Module:
        """The MLP of layer `layer_idx` (LFM2-MoE puts its experts here)."""
        return LlamaMLP(config, ctx, prefix, lfm2_intermediate_size(config))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.operator_norm(hidden)
        else:
            hidden, residual = self.operator_norm(hidden, residual)
        hidden = self.conv(hidden) if self.is_conv else self.self_attn(positions, hidden)
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.feed_forward(hidden), residual


class Lfm2Model(nn.Module):
    layer_cls = Lfm2DecoderLayer

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        # a pipeline stage builds its own layers only, as LlamaModel's
        self.hidden_size = config.hidden_size
        self.start, self.end = ctx.pp.layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.pp.is_first else None)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, ctx, f"model.layers.{i}") if self.start <= i < self.end
            else nn.Identity() for i in range(config.num_hidden_layers))
        self.embedding_norm = (RMSNorm(config.hidden_size, config.norm_eps, ctx)
                               if ctx.pp.is_last else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer(positions, hidden, residual)
        if self.embedding_norm is None:
            return hidden, residual
        hidden, _ = self.embedding_norm(hidden, residual)
        return hidden


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_cls = Lfm2Model
    is_hybrid = True
    supports_prompt_embeds = False  # its model embeds the token ids itself

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed(name: str) -> str:
            for ours, theirs in CHECKPOINT_RENAMES.items():
                name = name.replace(ours, theirs)
            return name
        return super().load_weights((renamed(name), tensor) for name, tensor in weights)
