"""Mamba 2: a stack of Mamba 2 mixers (no attention), each behind an RMSNorm with a residual
add; names as transformers' `Mamba2ForCausalLM` (`backbone.embeddings`, `backbone.layers.{i}`
with `norm` and `mixer`, `backbone.norm_f`, `lm_head`)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.mamba2_mixer import Mamba2Mixer
from runtime.models.llama import default_weight_loader


class Mamba2Block(nn.Module):
    def __init__(self, config, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)
        self.mixer = Mamba2Mixer(
            ctx, f"{prefix}.mixer", hidden_size=config.hidden_size, num_heads=config.num_heads,
            head_dim=config.head_dim, n_groups=config.n_groups, state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            intermediate_size=int(config.expand * config.hidden_size),
            use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
            eps=config.layer_norm_epsilon, chunk_size=config.chunk_size,
            time_step_limit=config.time_step_limit)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden), residual


class Mamba2Backbone(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(Mamba2Block(config, ctx, f"backbone.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class Mamba2ForCausalLM(nn.Module):
    is_hybrid = True  # all recurrent: its state lives in the state slots, it keeps no KV

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.pp.size > 1:
            raise ValueError("pipeline parallel is not supported for Mamba 2 yet")
        self.config = config
        self.backbone = Mamba2Backbone(config, ctx)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
