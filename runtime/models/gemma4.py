"""Gemma 4 (text, `Gemma4ForCausalLM`): the Gemma 3 layer plan with

- per-layer head sizes: global ("full_attention") layers have `global_head_dim` and, with
  `attention_k_eq_v`, their own KV heads whose values are the keys' projection; read per layer
  from the config's `per_layer_config`, and the KV cache holds each layer's own shape;
- Q, K and V normalised per head (V without a weight), attention scale 1, one rope per layer
  type (the global layers' "proportional" rope leaves most dims unrotated);
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V and attend over the cache of
  the last earlier layer of their type (`kv_sharing_modes`), optionally with a double-wide MLP;
- per-layer embeddings: a second embedding table gives every layer a small vector per token,
  mixed with a projection of the main embedding, gated into the residual stream after the MLP;
- RMSNorms that scale by `weight` in float32, a learned scalar per layer, final logit soft-cap;
- the MoE variant (`enable_moe_block`): every layer runs top-k gelu experts beside its dense
  MLP, routed from the residual stream, each branch with its own norms.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.pipeline import Intermediate
from runtime.layers.attention import Attention
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import (ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear, divide)
from runtime.layers.rotary import get_rope
from runtime.model_config import attention_heads
from runtime.models.gemma import Gemma2ForCausalLM
from runtime.models.llama import LlamaMLP, layer_sliding_window
from runtime.models.moe import MoeForCausalLM
from runtime.plugins.ops import rotary_embedding


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* weight], all in float32, back in x's dtype."""

    def __init__(self, size: int, eps: float, ctx: BuildContext, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = (nn.Parameter(torch.ones(size, dtype=ctx.dtype), requires_grad=False)
                       if with_scale else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x.dtype)


def kv_source_layer(config, layer_idx: int) -> int | None:
    """The layer whose K/V a KV-shared layer reads: the last layer of its type before the
    shared ones; None for a layer that computes its own."""
    if config.kv_sharing_modes[layer_idx] != "reuse":
        return None
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    layer_type = config.layer_types[layer_idx]
    return max(i for i in range(first_shared) if config.layer_types[i] == layer_type)


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads, self.head_size = attention_heads(config, layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        source = kv_source_layer(config, layer_idx)
        self.shares_kv = source is not None
        self.stores_kv = config.kv_sharing_modes[layer_idx] == "store"
        self.keys_are_values = (config.attention_k_eq_v and self.layer_type != "sliding_attention"
                                and not self.shares_kv)
        bias, eps = config.attention_bias, config.rms_norm_eps
        if self.shares_kv:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * self.head_size, bias, ctx,
                                               f"{prefix}.q_proj")
            self.num_heads = divide(num_heads, ctx.tp_size)
            self.num_kv_heads = max(1, num_kv_heads // ctx.tp_size)  # as the target's QKV
        else:
            self.qkv_proj = QKVParallelLinear(hidden, self.head_size, num_heads, num_kv_heads,
                                              bias, ctx, f"{prefix}.qkv_proj")
            self.num_heads = self.qkv_proj.num_heads
            self.num_kv_heads = self.qkv_proj.num_kv_heads
            self.k_norm = Gemma4RMSNorm(self.head_size, eps, ctx)
            self.v_norm = Gemma4RMSNorm(self.head_size, eps, ctx, with_scale=False)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.q_norm = Gemma4RMSNorm(self.head_size, eps, ctx)
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden, bias, ctx,
                                        f"{prefix}.o_proj")
        rope = SimpleNamespace(rope_parameters=config.rope_parameters[self.layer_type],
                               max_position_embeddings=config.max_position_embeddings)
        self.rotary_emb = get_rope(self.head_size,
                                   ctx.max_model_len or config.max_position_embeddings, rope,
                                   ctx.dtype)
        self.rotary_op = ctx.custom_op("rotary_embedding") or rotary_embedding
        # the vision model's image tokens attend both ways in the sliding layers only
        mm_prefix = (getattr(config, "use_bidirectional_attention", None) == "vision"
                     and self.layer_type == "sliding_attention")
        self.attn = Attention(self.num_heads, self.head_size, 1.0, self.num_kv_heads, ctx,
                              layer_sliding_window(config, layer_idx),
                              kv_sharing_target=(None if source is None else
                                                 f"model.layers.{source}.self_attn.attn"),
                              mm_prefix=mm_prefix)

    def _heads(self, x: torch.Tensor, norm: Gemma4RMSNorm) -> torch.Tensor:
        return norm(x.view(x.size(0), -1, self.head_size)).view(x.size(0), -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`shared_kv`: layer type -> the K/V (normalised, rotated) of this step's storing
        layer of that type, which KV-shared layers attend with."""
        cache = self.rotary_emb.cos_sin_cache
        if self.shares_kv:
            q = self._heads(self.q_proj(hidden), self.q_norm)
            # the portable op with no keys: a platform's op may rotate q and k in place
            q, _ = rotary_embedding(positions, q, q[:, :0], cache, self.head_size)
            k, v = shared_kv[self.layer_type]
        else:
            q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
            q, k = self._heads(q, self.q_norm), self._heads(k, self.k_norm)
            v = self._heads(v, self.v_norm)
            q, k = self.rotary_op(positions, q.contiguous(), k.contiguous(), cache,
                                  self.head_size)
            if self.stores_kv:
                shared_kv[self.layer_type] = k, v
        return self.o_proj(self.attn(q, k, v))


class Gemma4Router(nn.Module):
    """Top-k experts from the unweighted-RMS-normalised residual stream (times `scale` and
    hidden_size^-0.5): softmax, top-k renormalised, each weight times its expert's
    `per_expert_scale`."""

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        size, self.top_k = config.hidden_size, config.top_k_experts
        self.norm = Gemma4RMSNorm(size, config.rms_norm_eps, ctx, with_scale=False)
        self.proj = ReplicatedLinear(size, config.num_experts, False, ctx, f"{prefix}.proj")
        self.scale = nn.Parameter(torch.ones(size, dtype=ctx.dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts, dtype=ctx.dtype),
                                             requires_grad=False)
        self.root_size = size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k])."""
        logits = self.proj(self.norm(x) * self.scale * self.root_size)
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, ctx, f"{prefix}.self_attn")
        wide = config.use_double_wide_mlp and self.self_attn.shares_kv
        self.mlp = LlamaMLP(config, ctx, f"{prefix}.mlp",
                            config.intermediate_size * (2 if wide else 1))
        self.input_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps, ctx)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=ctx.dtype), requires_grad=False)
        self.per_layer_size = config.hidden_size_per_layer_input
        if self.per_layer_size:
            self.per_layer_input_gate = ReplicatedLinear(size, self.per_layer_size, False, ctx,
                                                         f"{prefix}.per_layer_input_gate")
            self.per_layer_projection = ReplicatedLinear(self.per_layer_size, size, False, ctx,
                                                         f"{prefix}.per_layer_projection")
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps, ctx)
        self.moe = bool(config.enable_moe_block)
        if self.moe:  # experts beside the dense MLP, each with its own norms
            self.router = Gemma4Router(config, ctx, f"{prefix}.router")
            self.experts = FusedMoE(config.num_experts, config.top_k_experts, size,
                                    config.moe_intermediate_size, True, ctx,
                                    activation=config.hidden_activation)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps, ctx)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(size, eps, ctx)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                per_layer_input: torch.Tensor | None,
                shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), shared_kv)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.moe:
            experts = self.experts.run_routed(self.pre_feedforward_layernorm_2(hidden),
                                       *self.router(hidden))
            mlp = (self.post_feedforward_layernorm_1(mlp)
                   + self.post_feedforward_layernorm_2(experts))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.per_layer_size:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh")
            projected = self.per_layer_projection(gate * per_layer_input)
            hidden = hidden + self.post_per_layer_input_norm(projected)
        return hidden * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.pp.size > 1:
            raise ValueError("Gemma 4 runs on one pipeline stage: its per-layer embeddings and "
                             "KV-shared layers read across stages (use tensor parallel)")
        self.hidden_size, self.num_layers = config.hidden_size, config.num_hidden_layers
        self.per_layer_size = config.hidden_size_per_layer_input
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        if self.per_layer_size:
            width = self.num_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                config.vocab_size_per_layer_input, width, ctx)
            self.per_layer_model_projection = ReplicatedLinear(
                config.hidden_size, width, False, ctx, "model.per_layer_model_projection")
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size,
                                                           config.rms_norm_eps, ctx)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, ctx, f"model.layers.{i}")
                                    for i in range(self.num_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, per-layer size]: the token's per-layer embedding and the projection of
        its main embedding, each normalised as transformers does, averaged (times sqrt 2)."""
        shape = (input_ids.size(0), self.num_layers, self.per_layer_size)
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = tokens * torch.tensor(self.per_layer_size ** 0.5, dtype=tokens.dtype)
        projected = self.per_layer_model_projection(embeds) * self.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + tokens.view(shape)) * 2.0 ** -0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # the normaliser is rounded to the activation dtype first, as in transformers
        return hidden * torch.tensor(self.hidden_size ** 0.5, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` (the vision model's merged text and image embeddings) replace the
        embedding of `input_ids`, which still key the per-layer embeddings."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, i],
                           shared_kv)
        return self.norm(hidden)


class Gemma4ForCausalLM(MoeForCausalLM, Gemma2ForCausalLM):
    """Gemma 2's final soft-cap; the MoE loader for the experts (stacked `experts.gate_up_proj`
    or per expert)."""

    model_cls = Gemma4Model
    supports_prompt_embeds = False  # its per-layer embeddings are looked up by token id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own: set[str] = set()
        return super().load_weights(self._own_attention_weights(weights, own)) | own

    def _own_attention_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                               loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Llama loader's stream, but KV-shared layers' `q_proj` loaded here (they have no
        fused QKV) and a keys-are-values layer's `k_proj` loaded into V as well."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn":
                attention = self.model.layers[int(parts[2])].self_attn
                if attention.shares_kv and parts[4] == "q_proj":
                    param = params[name]
                    param.weight_loader(param, tensor)
                    loaded.add(name)
                    continue
                if parts[4] == "k_proj" and attention.keys_are_values:
                    yield name.replace(".k_proj.", ".v_proj."), tensor
            yield name, tensor
