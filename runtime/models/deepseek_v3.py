"""DeepSeek-V3 (and Kimi K2, which uses its class) and DeepSeek-V2: multi-head latent attention
(MLA) and a mixture of experts with grouped top-k routing, on our layers.

Attention compresses each token's K/V into a `kv_lora_rank` latent (`kv_a_proj_with_mqa`, then
`kv_a_layernorm`) plus one shared rope key of `qk_rope_head_dim`; the paged cache keeps only
these (`MLAAttention`), and `kv_b_proj` expands them to per-head keys (`qk_nope_head_dim`) and
values (`v_head_dim`) inside the backend. Queries come from `q_proj`, or through the low-rank
`q_a_proj` -> `q_a_layernorm` -> `q_b_proj` when `q_lora_rank` is set. DeepSeek checkpoints
store the rope dimensions in interleaved pairs (`rope_interleave`); their rows are reordered at
load time, so the rotation is the neox one of our rotary op. The softmax scale carries YaRN's
`mscale_all_dim` squared, as transformers computes it.

The first `first_k_dense_replace` layers have a dense MLP; the others route each token with
sigmoid scores: the `n_group` expert groups ranked by the sum of their two best scores (plus
`e_score_correction_bias`), the best `topk_group` kept, the top-k experts of those chosen by
biased score and weighted by the unbiased one (renormalised with `norm_topk_prob`), times
`routed_scaling_factor`; `n_shared_experts` shared experts run on every token. DeepSeek-V2
routes by softmax instead (`greedy_topk`), with no correction bias.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.mla_attention import MLAAttention
from runtime.layers.rotary import get_rope, rope_parameters, rotary_embedding
from runtime.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from runtime.models.moe import MoeForCausalLM
from runtime.quantization.base import UnquantizedLinearMethod

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class DeepseekV3Attention(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, v_dim = config.qk_nope_head_dim, config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        total_heads = config.num_attention_heads
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_dim, False, ctx,
                                               f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias, ctx,
                                             f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, ctx)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, total_heads * qk_dim, False,
                                                 ctx, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim,
                                                   bias, ctx, f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ctx)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_heads * (self.nope_dim + v_dim), False, ctx,
                                              f"{prefix}.kv_b_proj")
        if not isinstance(self.kv_b_proj.method, UnquantizedLinearMethod):
            raise ValueError(f"{prefix}.kv_b_proj is quantized; MLA absorbs its dense weight "
                             f"into the attention, so it must stay unquantized")
        self.o_proj = RowParallelLinear(total_heads * v_dim, hidden, bias, ctx,
                                        f"{prefix}.o_proj")
        self.num_heads = total_heads // ctx.tp_size
        self.rotary_emb = get_rope(self.rope_dim,
                                   ctx.max_model_len or config.max_position_embeddings,
                                   config, ctx.dtype)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.nope_dim,
                                 self.rope_dim, v_dim, softmax_scale(config),
                                 self.kv_b_proj.weight, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.size(0)
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim],
                                                           -1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotate(positions, q[..., self.nope_dim:].reshape(t, -1),
                                 k_pe.contiguous())
        out = self.attn(q[..., :self.nope_dim], q_pe.view(t, self.num_heads, self.rope_dim),
                        kv_c, k_pe)
        return self.o_proj(out)

    def rotate(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope parts of the queries [T, H * rope] and of the shared key [T, rope]."""
        return self.rotary_op(positions, q_pe, k_pe, self.rotary_emb.cos_sin_cache,
                              self.rope_dim)


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, num_groups: int, topk_groups: int,
                 top_k: int, renormalize: bool, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing of router `logits` [T, E] (float32): (weights [T, k] float32,
    expert ids [T, k])."""
    scores = logits.sigmoid()
    biased = scores + bias
    num_tokens, num_experts = biased.shape
    groups = biased.view(num_tokens, num_groups, -1)
    group_scores = groups.topk(2, dim=-1)[0].sum(-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_groups, dim=-1)[1], True)
    biased = biased.masked_fill(~kept.repeat_interleave(num_experts // num_groups, 1),
                                float("-inf"))
    ids = biased.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def greedy_topk(logits: torch.Tensor, num_groups: int | None, topk_groups: int | None,
                top_k: int, method: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing of router `logits` [T, E] (float32): softmax scores; with
    "group_limited_greedy" only the experts of the `topk_groups` groups with the best single
    score compete. The top-k weights as scored (not renormalised), times `scaling`."""
    scores = logits.softmax(-1)
    if method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        group_scores = scores.view(num_tokens, num_groups, -1).max(-1).values
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1)[1], True)
        scores = scores.masked_fill(~kept.repeat_interleave(num_experts // num_groups, 1), 0.0)
    weights, ids = scores.topk(top_k, dim=-1)
    return weights * scaling, ids


class DeepseekV3Router(nn.Module):
    """The router's weight (and V3's score-correction bias), kept in float32 as transformers
    runs them."""

    def __init__(self, config, correction_bias: bool) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekV3MoE(nn.Module):
    correction_bias = True  # V3's e_score_correction_bias; V2 has none

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        if config.n_group and config.n_routed_experts % config.n_group:
            raise ValueError(f"n_routed_experts {config.n_routed_experts} is not divisible by "
                             f"n_group {config.n_group}")
        self.config = config
        self.gate = DeepseekV3Router(config, self.correction_bias)
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size, False, ctx)
        self.shared_experts = (LlamaMLP(config, ctx, f"{prefix}.shared_experts",
                                        config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return grouped_topk(logits, self.gate.e_score_correction_bias, c.n_group, c.topk_group,
                            c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.run_routed(x, *self.route(self.gate(x)))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2MoE(DeepseekV3MoE):
    correction_bias = False

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {config.topk_method!r} is not supported; "
                             f"supported: greedy, group_limited_greedy")
        super().__init__(config, ctx, prefix)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return greedy_topk(logits, c.n_group, c.topk_group, c.num_experts_per_tok,
                           c.topk_method, c.routed_scaling_factor)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV3Attention
    moe_cls = DeepseekV3MoE

    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return LlamaMLP(config, ctx, prefix)
        return self.moe_cls(config, ctx, prefix)


class DeepseekV3Model(LlamaModel):
    layer_cls = DeepseekV3DecoderLayer


class DeepseekV2DecoderLayer(DeepseekV3DecoderLayer):
    moe_cls = DeepseekV2MoE


class DeepseekV2Model(LlamaModel):
    layer_cls = DeepseekV2DecoderLayer


class DeepseekV3ForCausalLM(MoeForCausalLM):
    model_cls = DeepseekV3Model
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._deinterleave_rope(weights))

    def _deinterleave_rope(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop the multi-token-prediction layers (past `num_hidden_layers`; the engine does
        not run them) and, with `rope_interleave`, reorder each head's rope rows of the query
        and shared-key projections from pairs (x0, x1), (x2, x3) ... to evens then odds."""
        c = self.config
        rope, nope, rank = c.qk_rope_head_dim, c.qk_nope_head_dim, c.kv_lora_rank
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        for name, tensor in weights:
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) \
                    >= c.num_hidden_layers:
                continue
            if getattr(c, "rope_interleave", True):
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                    heads = tensor.view(c.num_attention_heads, nope + rope, -1)
                    tensor = torch.cat((heads[:, :nope], heads[:, nope + order]), 1)
                    tensor = tensor.flatten(0, 1)
                elif ".self_attn.kv_a_proj_with_mqa." in name:
                    tensor = torch.cat((tensor[:rank], tensor[rank + order]))
            yield name, tensor


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """The same MLA; softmax routing without score correction; rope always interleaved."""

    model_cls = DeepseekV2Model
