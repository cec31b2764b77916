"""Qwen3-Next: the Qwen3.5 hybrid (gated delta-nets + gated attention) with Qwen2-MoE-style
sparse layers (`decoder_sparse_step`, `mlp_only_layers`, a gated shared expert).

Its checkpoint projects the delta-net's inputs in two tensors laid out per key-head group:
`in_proj_qkvz` [q, k, v, z of the group's value heads] and `in_proj_ba` [b, a]. They are cut
into Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` as they stream in.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.llama import LlamaMLP
from runtime.models.moe import MoeForCausalLM, SparseMoeBlock
from runtime.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5Model


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        sparse = (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(config, ctx, prefix)
        return SparseMoeBlock(config, ctx, prefix, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob),
                              config.shared_expert_intermediate_size)


class Qwen3NextModel(Qwen3_5Model):
    layer_cls = Qwen3NextDecoderLayer


def split_grouped_projections(config, name: str, tensor: torch.Tensor
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """`in_proj_qkvz` / `in_proj_ba` as Qwen3.5's four projections (heads in the same order:
    value head g * r + j is the j-th of key group g); any other tensor as it is."""
    groups, dk = config.linear_num_key_heads, config.linear_key_head_dim
    r = config.linear_num_value_heads // groups
    dv = config.linear_value_head_dim
    hidden = tensor.size(-1)
    if name.endswith(".in_proj_qkvz.weight"):
        q, k, v, z = tensor.view(groups, -1, hidden).split([dk, dk, r * dv, r * dv], 1)
        base = name[:-len("in_proj_qkvz.weight")]
        yield f"{base}in_proj_qkv.weight", torch.cat(
            [t.reshape(-1, hidden) for t in (q, k, v)])
        yield f"{base}in_proj_z.weight", z.reshape(-1, hidden)
    elif name.endswith(".in_proj_ba.weight"):
        b, a = tensor.view(groups, 2 * r, hidden).split([r, r], 1)
        base = name[:-len("in_proj_ba.weight")]
        yield f"{base}in_proj_b.weight", b.reshape(-1, hidden)
        yield f"{base}in_proj_a.weight", a.reshape(-1, hidden)
    else:
        yield name, tensor


class Qwen3NextForCausalLM(MoeForCausalLM):
    model_cls = Qwen3NextModel
    is_hybrid = True
    stacked_params = Qwen3_5ForCausalLM.stacked_params

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(
            part for name, tensor in weights
            for part in split_grouped_projections(self.config, name, tensor))
