"""Nemotron-H (`NemotronHForCausalLM`): a stack of blocks, each one mixer behind an RMSNorm
with a residual add, the mixer named by the config's `layer_types` (its
`hybrid_override_pattern`): a Mamba 2 mixer (`M`), attention without rotary embeddings (`*`),
a squared-ReLU MLP (`-`) or a mixture of squared-ReLU experts (`E`, Nemotron 3: DeepSeek-V3's
sigmoid routing with its correction bias, a shared expert, optionally through a latent
projection). Checkpoint names: `backbone.embeddings`,
`backbone.layers.{i}.norm` and `.mixer`, `backbone.norm_f`, `lm_head`.

The experts are ungated, which the fused MoE op does not run: they run one expert at a time,
as transformers runs them. The Mamba 2 step sizes are clamped to `time_step_limit` in prefill
(and not in decode), as in every Mamba 2 mixer; transformers before 5.25 clamped them to
`time_step_min` from below instead."""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from runtime.distributed.pipeline import Intermediate
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                   divide)
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.deepseek_v3 import DeepseekV3Router, grouped_topk
from runtime.models.jamba import NoRopeAttention
from runtime.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class ReluSquaredMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"Nemotron-H: MLP activation {config.mlp_hidden_act!r} is not "
                             "supported (relu2 only)")
        size = intermediate_size or config.intermediate_size
        self.up_proj = ColumnParallelLinear(config.hidden_size, size, config.mlp_bias, ctx,
                                            f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, ctx,
                                           f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


class UngatedExperts(nn.Module):
    """Stacked squared-ReLU experts as the checkpoint keeps them, `up_proj` [E, I, D] and
    `down_proj` [E, D, I] (D the hidden or latent size). Under tensor parallel each rank holds
    every expert's share of I (rows of up, columns of down), and the partial outputs are
    summed over the ranks, as the fused MoE op's are."""

    def __init__(self, num_experts: int, size: int, intermediate_size: int,
                 ctx: BuildContext) -> None:
        super().__init__()
        self.shard = divide(intermediate_size, ctx.tp_size)
        self.tp_rank, self.tp_size, self.tp_group = ctx.tp_rank, ctx.tp_size, ctx.tp_group
        self.up_proj = nn.Parameter(torch.empty(num_experts, self.shard, size,
                                                dtype=ctx.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, size, self.shard,
                                                  dtype=ctx.dtype), requires_grad=False)
        self.up_proj.weight_loader = self.load_stacked
        self.down_proj.weight_loader = self.load_stacked

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int) -> None:
        """One expert's `up_proj` [I, D] or `down_proj` [D, I]: this rank's slice of I."""
        lo = self.tp_rank * self.shard
        if param is self.up_proj:
            param.data[expert].copy_(loaded[lo:lo + self.shard])
        else:
            param.data[expert].copy_(loaded[:, lo:lo + self.shard])

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        for expert in range(loaded.size(0)):
            self.load_expert(param, loaded[expert], expert)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            y = relu_squared(x[token] @ self.up_proj[expert].t()) @ self.down_proj[expert].t()
            out.index_add_(0, token, (y * weights[token, slot, None]).float())
        if self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out.to(x.dtype)


class NemotronHMoE(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        if config.n_routed_experts % config.n_group:
            raise ValueError(f"n_routed_experts {config.n_routed_experts} is not divisible by "
                             f"n_group {config.n_group}")
        self.config = config
        self.gate = DeepseekV3Router(config, correction_bias=True)
        latent = config.moe_latent_size
        self.experts = UngatedExperts(config.n_routed_experts, latent or config.hidden_size,
                                      config.moe_intermediate_size, ctx)
        self.shared_experts = ReluSquaredMLP(config, ctx, f"{prefix}.shared_experts",
                                             config.moe_shared_expert_intermediate_size)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, latent, config.mlp_bias,
                                                    ctx, f"{prefix}.fc1_latent_proj")
            self.fc2_latent_proj = ReplicatedLinear(latent, config.hidden_size, config.mlp_bias,
                                                    ctx, f"{prefix}.fc2_latent_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = grouped_topk(self.gate(x), self.gate.e_score_correction_bias, c.n_group,
                                    c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
                                    c.routed_scaling_factor)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, weights, ids)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


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
                time_step_limit=config.time_step_limit)
        elif self.layer_type == "full_attention":
            self.mixer = NoRopeAttention(config, layer_idx, ctx, f"{prefix}.mixer")
        elif self.layer_type == "mlp":
            self.mixer = ReluSquaredMLP(config, ctx, f"{prefix}.mixer")
        else:
            self.mixer = NemotronHMoE(config, ctx, f"{prefix}.mixer")

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
        # a pipeline stage builds its own layers only, as LlamaModel's
        self.start, self.end = ctx.pp.layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if ctx.pp.is_first else None)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, ctx, f"model.layers.{i}") if self.start <= i < self.end
            else nn.Identity() for i in range(config.num_hidden_layers))
        self.norm = (RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)
                     if ctx.pp.is_last else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | Intermediate:
        """`inputs_embeds` (a prompt given as embeddings) replace the embedding of input_ids;
        a stage after the first starts from the previous one's `intermediate`."""
        if intermediate is None:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = intermediate
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:
            return hidden, residual
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
        `model.`, its `embeddings` and `norm_f` our `embed_tokens` and `norm`; experts saved
        one by one (`experts.{j}.up_proj.weight`) go into their stacked parameters."""
        loaded: set[str] = set()
        modules = dict(self.named_modules())

        def ours(name: str) -> str:
            if name.startswith("backbone."):
                name = "model." + name[len("backbone."):]
            for theirs, mine in (("model.embeddings.", "model.embed_tokens."),
                                 ("model.norm_f.", "model.norm.")):
                if name.startswith(theirs):
                    return mine + name[len(theirs):]
            return name

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = ours(name)
                if not self.pp.owns(name, self.config.num_hidden_layers):
                    continue  # another pipeline stage's
                expert = _EXPERT.match(name)
                if expert is None:
                    yield name, tensor
                    continue
                experts = modules[expert.group(1)]
                experts.load_expert(getattr(experts, expert.group(3)), tensor,
                                    int(expert.group(2)))
                loaded.add(f"{expert.group(1)}.{expert.group(3)}")
        return super().load_weights(others()) | loaded
