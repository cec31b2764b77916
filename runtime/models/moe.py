"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE,
as the Llama/Qwen layers with the MLP replaced by a sparse block around `FusedMoE`.

Checkpoints store one tensor per expert and projection (`experts.{j}.gate_proj` / `w1`, `up_proj`
/ `w3`, `down_proj` / `w2`), or all experts stacked as transformers 5 does
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); either is copied into the
stacked expert weights as it streams in. Mixtral names its block `block_sparse_moe`, read here as
`mlp`; a class renames other checkpoint names through `checkpoint_renames`.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.linear import ReplicatedLinear
from runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from runtime.models.qwen import Qwen2Attention, Qwen3Attention

_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_STACKED = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)$")
_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
          "w2": "down"}


class SparseMoeBlock(nn.Module):
    """Router, experts and, when `shared_intermediate_size` is set, a shared expert whose
    output is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    def __init__(self, config, ctx: BuildContext, prefix: str, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, num_experts, False, ctx, f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate_size, renormalize, ctx)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, ctx, f"{prefix}.shared_expert",
                                          shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, False, ctx,
                                                       f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        return SparseMoeBlock(config, ctx, prefix, config.num_local_experts,
                              config.num_experts_per_tok, config.intermediate_size, True)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention

    def build_mlp(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> nn.Module:
        sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                  and config.num_experts > 0
                  and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
        if not sparse:
            return LlamaMLP(config, ctx, prefix)
        return SparseMoeBlock(config, ctx, prefix, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob),
                              getattr(config, "shared_expert_intermediate_size", None))


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention


class MoeForCausalLM(LlamaForCausalLM):
    """Loads per-expert or stacked checkpoint tensors into the stacked expert weights; the rest
    goes through the Llama loader."""

    # checkpoint name part -> ours, applied before anything else (a family's own MoE names)
    checkpoint_renames: dict[str, str] = {".block_sparse_moe.": ".mlp."}
    # stacked experts stored [E, in, out] (Llama 4) rather than [E, out, in]
    stacked_experts_transposed = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts_loaded: set[str] = set()
        loaded = super().load_weights(self._load_experts(weights, experts_loaded))
        return loaded | experts_loaded

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but the experts', which it loads (adding their names to `loaded`)."""
        modules = dict(self.named_modules())
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            for ours, theirs in self.checkpoint_renames.items():
                name = name.replace(ours, theirs)
            stacked = _STACKED.match(name)
            match = stacked or _EXPERT.match(name)
            if match is None:
                yield name, tensor
                continue
            if not self.pp.owns(name, num_layers):
                continue
            if stacked:
                experts = modules[f"{stacked.group(1)}.experts"]
                part = "down" if stacked.group(2) == "down_proj" else "gate_up"
                if self.stacked_experts_transposed:
                    tensor = tensor.transpose(1, 2)
                experts.load_stacked(tensor, part)
                loaded.add(f"{stacked.group(1)}.experts."
                           f"{'w2_weight' if part == 'down' else 'w13_weight'}")
                continue
            block, expert, part = match.group(1), int(match.group(2)), _PARTS[match.group(3)]
            experts = modules[f"{block}.experts"]
            param_name = f"{block}.experts.{'w2_weight' if part == 'down' else 'w13_weight'}"
            param = experts.w2_weight if part == "down" else experts.w13_weight
            experts.load_expert(param, tensor, expert, part)
            loaded.add(param_name)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoeForCausalLM):
    model_cls = MixtralModel


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen2MoeModel


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_cls = Qwen3MoeModel
