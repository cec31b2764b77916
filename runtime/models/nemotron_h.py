"""Nemotron-H (`NemotronHForCausalLM`): a stack of blocks, each one mixer behind an RMSNorm
with a residual add, the mixer named by the config's `layer_types` (its
`hybrid_override_pattern`): a Mamba 2 mixer (`M`), attention without rotary embeddings (`*`)
or a squared-ReLU MLP (`-`). Checkpoint names: `backbone.embeddings`,
`backbone.layers.{i}.norm` and `.mixer`, `backbone.norm_f`, `lm_head`.

Its MoE layers (`E`, Nemotron 3) are refused: their experts are ungated squared-ReLU MLPs,
which the fused MoE layer does not run. Transformers clamps the Mamba 2 step sizes to
`time_step_min` from below in prefill (and not in decode), whatever `time_step_limit` says;
so does this model."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.jamba import NoRopeAttention
from runtime.models.llama import LlamaForCausalLM


class ReluSquaredMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"Nemotron-H: MLP activation {config.mlp_hidden_act!r} is not "
                             "supported (relu2 only)")
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                            config.mlp_bias, ctx, f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           config.mlp_bias, ctx, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, config, layer_idx: int, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)
        if self.layer_type == "linear_attention":
            if config.mamba_hidden_act not in ("silu", "swish"):
                raise ValueError(f"Nemotron-H: Mamba activation {config.mamba_hidden_act!r} "
                                 "is not supported (silu only)")
            self.mixer = Mamba2Mixer(
                ctx, f"{prefix}.mixer", hidden_size=config.hidden_size,
                num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
                n_groups=config.n_groups, state_size=config.ssm_state_size,
                conv_kernel=config.conv_kernel,
                intermediate_size=config.mamba_num_heads * config.mamba_head_dim,
                use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
                eps=config.layer_norm_epsilon, chunk_size=config.chunk_size,
                time_step_limit=(config.time_step_min, float("inf")))
        elif self.layer_type == "full_attention":
            self.mixer = NoRopeAttention(config, layer_idx, ctx, f"{prefix}.mixer")
        elif self.layer_type == "mlp":
            self.mixer = ReluSquaredMLP(config, ctx, f"{prefix}.mixer")
        else:
            raise ValueError(f"Nemotron-H: {self.layer_type!r} layers are not supported "
                             "natively yet (their experts are ungated squared-ReLU MLPs, "
                             "which the fused MoE layer does not run)")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.layer_type == "full_attention":
            return self.mixer(positions, hidden), residual
        return self.mixer(hidden), residual


class NemotronHModel(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.pp.size > 1:
            raise ValueError("pipeline parallel is not supported for Nemotron-H yet")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(NemotronHBlock(config, i, ctx, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: None = None) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class NemotronHForCausalLM(LlamaForCausalLM):
    model_cls = NemotronHModel
    is_hybrid = True
    # its MLP's `up_proj` is a projection of its own, not half of a gated pair
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `backbone.` (as saved; `model.` in transformers' modules) is our
        `model.`, its `embeddings` and `norm_f` our `embed_tokens` and `norm`."""
        def ours(name: str) -> str:
            if name.startswith("backbone."):
                name = "model." + name[len("backbone."):]
            for theirs, mine in (("model.embeddings.", "model.embed_tokens."),
                                 ("model.norm_f.", "model.norm.")):
                if name.startswith(theirs):
                    return mine + name[len(theirs):]
            return name
        return super().load_weights((ours(name), tensor) for name, tensor in weights)
