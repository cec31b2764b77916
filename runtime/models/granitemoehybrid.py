"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba 2 mixers (`mamba` layers) and attention
(rotary or none, `position_embedding_type`), each layer's MLP a top-k MoE plus a shared MLP
(or the shared MLP alone without experts); Granite's multipliers scale the embeddings, the
attention scores, each residual branch and the logits.

The checkpoint keeps the experts stacked (`block_sparse_moe.input_linear` [E, 2I, H] of gate
then up, `output_linear` [E, H, I]) and the shared MLP fused (`shared_mlp.input_linear`); they
are cut into our layers' shards as they stream in.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.granite import GraniteModel
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GraniteMoeHybridAttention(LlamaAttention):
    def attention_scale(self, config) -> float:
        return config.attention_multiplier

    def uses_rope(self, config) -> bool:
        return config.position_embedding_type == "rope"


class GraniteMoeHybridMoE(nn.Module):
    """Router (softmax over the top-k logits: the renormalised top-k) and stacked experts."""

    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, False, ctx,
                                       f"{prefix}.router")
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                                config.hidden_size, config.intermediate_size, True, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.mamba = Mamba2Mixer.from_hybrid_config(config, ctx, f"{prefix}.mamba")
        else:
            self.self_attn = GraniteMoeHybridAttention(config, layer_idx, ctx,
                                                       f"{prefix}.self_attn")
        self.block_sparse_moe = (GraniteMoeHybridMoE(config, ctx, f"{prefix}.block_sparse_moe")
                                 if config.num_local_experts > 0 else None)
        self.shared_mlp = LlamaMLP(config, ctx, f"{prefix}.shared_mlp",
                                   config.shared_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.mamba(hidden)
        else:
            hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden * self.residual_multiplier,
                                                         residual)
        out = self.shared_mlp(hidden)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridModel(GraniteModel):
    layer_cls = GraniteMoeHybridDecoderLayer


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    model_cls = GraniteMoeHybridModel
    is_hybrid = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        return super().load_weights(self._load_experts(weights, loaded)) | loaded

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the stacked experts itself (adding their names to `loaded`); yields the
        shared MLP's fused projection as its gate and up halves, and everything else."""
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if not self.pp.owns(name, self.config.num_hidden_layers):
                continue  # another pipeline stage's layer
            if ".block_sparse_moe.router.layer." in name:
                yield name.replace(".router.layer.", ".router."), tensor
            elif ".block_sparse_moe.input_linear." in name or \
                    ".block_sparse_moe.output_linear." in name:
                block = name.split(".block_sparse_moe.")[0] + ".block_sparse_moe"
                experts = modules[f"{block}.experts"]
                down = ".output_linear." in name
                param = experts.w2_weight if down else experts.w13_weight
                for j, expert in enumerate(tensor):
                    if down:
                        experts.load_expert(param, expert, j, "down")
                    else:
                        gate, up = expert.chunk(2, dim=0)
                        experts.load_expert(param, gate, j, "gate")
                        experts.load_expert(param, up, j, "up")
                loaded.add(f"{block}.experts.{'w2_weight' if down else 'w13_weight'}")
            elif ".shared_mlp.input_linear." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".input_linear.", ".gate_proj."), gate
                yield name.replace(".input_linear.", ".up_proj."), up
            elif ".shared_mlp.output_linear." in name:
                yield name.replace(".output_linear.", ".down_proj."), tensor
            else:
                yield name, tensor
