"""gpt-oss (GptOssForCausalLM): the Llama layers with attention sinks, biased q/k/v/o, YaRN rope
and, in every layer, a mixture of experts with a biased router and a clamped SwiGLU.

Layers alternate between a sliding window (the config's `layer_types`) and full attention; every
layer has one learned sink logit per query head (`self_attn.sinks`), which the attention backend
adds to each softmax. The router picks the top-k of its logits and softmaxes those. Each expert
computes `(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`, then
its down projection, both with biases, as transformers' GptOssExperts does.

Checkpoints hold each layer's experts stacked, transposed and with gate and up interleaved:
`experts.gate_up_proj` [E, H, 2I] (column 2j is gate j, 2j + 1 up j), `gate_up_proj_bias`
[E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]. They are split per expert into the
stacked `w13` (gate | up) [E, 2I, H] and `w2` [E, H, I] of `FusedMoE` as they stream in, so
tensor and expert parallel shard them as they shard every MoE model. MXFP4 checkpoints
(transformers' `quant_method: mxfp4`, `runtime.quantization.fp4.Mxfp4ExpertsConfig`) hold the
two weight tensors as `_blocks`/`_scales` [E, out, in / 32, ...] instead; they are decoded to
the model dtype (exactly: e2m1 times a power of two) and loaded as the dense ones are, so the
experts then take the memory of a bf16 checkpoint.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import ReplicatedLinear
from runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.quantization.fp4 import dequantize_mx_blocks

_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def route_top_k(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k router logits, softmaxed among themselves in float32: (weights [T, k],
    expert ids [T, k])."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids


def gpt_oss_experts(hidden: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor,
                    w2: torch.Tensor, b2: torch.Tensor | None, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: hidden [T, H]; w13 [E, 2I, H] (gate | up rows) with bias b13 [E, 2I];
    w2 [E, H, I] with bias b2 [E, H] (None: added on another rank); token t goes to experts
    topk_ids[t] [k] weighted by topk_weights[t] [k] (-1: an expert this rank does not hold).
    The (token, expert) pairs are grouped by expert with one sort; each expert with tokens runs
    one GEMM pair over its group."""
    num_tokens, top_k = topk_ids.shape
    inter = w2.size(2)
    flat_ids = topk_ids.flatten()
    counts = torch.bincount(flat_ids + 1, minlength=w13.size(0) + 1).tolist()
    order = flat_ids.argsort(stable=True)[counts[0]:]  # the -1 pairs sort first
    rows = hidden[order // top_k]
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts[1:]):
        if not count:
            continue
        gate_up = rows[start:start + count] @ w13[expert].t() + b13[expert]
        gate = gate_up[:, :inter].clamp(max=limit)
        up = gate_up[:, inter:].clamp(-limit, limit)
        y = ((up + 1) * gate * torch.sigmoid(gate * alpha)) @ w2[expert].t()
        out[start:start + count] = y if b2 is None else y + b2[expert]
        start += count
    weighted = out * topk_weights.flatten()[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, order // top_k, weighted)


class GptOssExperts(FusedMoE):
    """`FusedMoE`'s stacked weights plus their biases; the down bias is added by the rank that
    holds the whole expert (expert parallel) or by tensor-parallel rank 0 only."""

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                         config.intermediate_size, True, ctx)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.w13_bias = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.shard, dtype=ctx.dtype),
            requires_grad=False)
        self.w2_bias = nn.Parameter(
            torch.empty(self.num_local_experts, config.hidden_size, dtype=ctx.dtype),
            requires_grad=False)
        self.adds_down_bias = self.expert_map is not None or self.tp_rank == 0

    def load_stacked(self, name: str, loaded: torch.Tensor) -> None:
        """One of the checkpoint's stacked expert tensors (`_EXPERT_TENSORS`), every expert."""
        lo = 0 if self.expert_map is not None else self.tp_rank * self.shard
        for expert in range(self.num_experts):
            local = expert - self.first_expert
            if name == "gate_up_proj":
                self.load_expert(self.w13_weight, loaded[expert, :, 0::2].t(), expert, "gate")
                self.load_expert(self.w13_weight, loaded[expert, :, 1::2].t(), expert, "up")
            elif name == "down_proj":
                self.load_expert(self.w2_weight, loaded[expert].t(), expert, "down")
            elif not 0 <= local < self.num_local_experts:
                continue
            elif name == "gate_up_proj_bias":
                gate, up = loaded[expert, 0::2], loaded[expert, 1::2]
                self.w13_bias.data[local].copy_(
                    torch.cat([gate[lo:lo + self.shard], up[lo:lo + self.shard]]))
            else:
                self.w2_bias.data[local].copy_(loaded[expert])

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_k(router_logits, self.top_k)
        if self.expert_map is not None:
            ids = self.expert_map[ids]
        out = gpt_oss_experts(hidden, self.w13_weight, self.w13_bias, self.w2_weight,
                              self.w2_bias if self.adds_down_bias else None, weights, ids,
                              self.alpha, self.limit)
        if self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out


class GptOssMoE(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, True, ctx,
                                       f"{prefix}.router")
        self.experts = GptOssExperts(config, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssAttention(LlamaAttention):
    attention_sinks = True


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        return GptOssMoE(config, ctx, prefix)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel
    attention_sinks = True  # read by ModelConfig: backends must apply sinks

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts_loaded: set[str] = set()
        loaded = super().load_weights(self._load_special(weights, experts_loaded))
        return loaded | experts_loaded

    def _load_special(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked experts, loaded here (their names added to `loaded`); the sinks renamed
        to the attention layer's parameter; every other tensor passed on."""
        modules = dict(self.named_modules())
        params = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_bias",
                  "down_proj": "w2_weight", "down_proj_bias": "w2_bias"}
        num_layers = self.config.num_hidden_layers
        mx_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # until both arrive
        for name, tensor in weights:
            if name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                continue
            block, _, leaf = name.rpartition(".")
            if not block.endswith(".mlp.experts"):
                yield name, tensor
                continue
            if not self.pp.owns(name, num_layers):
                continue
            proj, _, part = leaf.rpartition("_")
            if part in ("blocks", "scales") and proj in ("gate_up_proj", "down_proj"):
                parts = mx_parts.setdefault((block, proj), {})
                parts[part] = tensor
                if len(parts) < 2:
                    continue
                del mx_parts[block, proj]
                # [E, out, in] -> the dense checkpoint's [E, in, out]
                leaf = proj
                tensor = dequantize_mx_blocks(parts["blocks"], parts["scales"]).transpose(1, 2)
            elif leaf not in _EXPERT_TENSORS:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            modules[block].load_stacked(leaf, tensor)
            loaded.add(f"{block}.{params[leaf]}")
