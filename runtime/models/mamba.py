"""Mamba (Mamba 1): a stack of Mamba mixers (no attention), each behind an RMSNorm with a
residual add; names as transformers' `MambaForCausalLM` (`backbone.embeddings`,
`backbone.layers.{i}` with `norm` and `mixer`, `backbone.norm_f`, `lm_head`). Mamba 2 is the
same stack of Mamba 2 mixers (runtime.models.mamba2).

With `residual_in_fp32` (the configs' default) the residual stream is kept in float32, as
transformers keeps it: each layer's norm reads it rounded to the model dtype, the final norm
reads it whole. Pipeline stages split the layers; a stage keeps no KV (it has no attention)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.distributed.pipeline import Intermediate
from runtime.layers.build_context import BuildContext
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.layernorm import RMSNorm
from runtime.layers.mamba_mixer import MambaMixer
from runtime.models.llama import default_weight_loader


class MambaBlock(nn.Module):
    def __init__(self, config, mixer: nn.Module, ctx: BuildContext) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)
        self.mixer = mixer
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))
        self.dtype = ctx.dtype

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.residual_in_fp32:
            residual = hidden.float() if residual is None else residual + hidden
            return self.mixer(self.norm(residual.to(self.dtype))), residual
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden), residual


class MambaBackbone(nn.Module):
    def __init__(self, config, ctx: BuildContext, mixers: dict[int, nn.Module]) -> None:
        super().__init__()
        # a pipeline stage builds its own layers only, as LlamaModel's
        self.start, self.end = ctx.pp.layers(config.num_hidden_layers)
        self.embeddings = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                           if ctx.pp.is_first else None)
        self.layers = nn.ModuleList(MambaBlock(config, mixers[i], ctx) if i in mixers
                                    else nn.Identity() for i in range(config.num_hidden_layers))
        self.norm_f = (RMSNorm(config.hidden_size, config.layer_norm_epsilon, ctx)
                       if ctx.pp.is_last else None)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))
        self.dtype = ctx.dtype

    def forward(self, input_ids: torch.Tensor, intermediate: Intermediate | None = None
                ) -> torch.Tensor | Intermediate:
        """A stage after the first starts from the previous one's `intermediate`; with a
        float32 residual the stages exchange both tensors in float32 (the worker receives in
        the model's `intermediate_dtype`), the hidden states cast back on arrival."""
        if intermediate is None:
            hidden, residual = self.embeddings(input_ids), None
        else:
            hidden, residual = intermediate
            hidden = hidden.to(self.dtype)
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer(hidden, residual)
        if self.norm_f is None:
            return hidden.to(residual.dtype), residual
        if self.residual_in_fp32:
            h = residual + hidden
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_f.eps)
            return (h * self.norm_f.weight.float()).to(hidden.dtype)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class MambaForCausalLM(nn.Module):
    is_hybrid = True  # all recurrent: its state lives in the state slots, it keeps no KV
    name = "Mamba"

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config, self.pp = config, ctx.pp
        start, end = ctx.pp.layers(config.num_hidden_layers)
        mixers = {i: self.build_mixer(config, ctx, f"backbone.layers.{i}.mixer")
                  for i in range(start, end)}
        self.backbone = MambaBackbone(config, ctx, mixers)
        if getattr(config, "residual_in_fp32", False):
            self.intermediate_dtype = torch.float32
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, ctx)
                        if ctx.pp.is_last else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and ctx.pp.size == 1:
            self.lm_head.weight = self.backbone.embeddings.weight

    def build_mixer(self, config, ctx: BuildContext, prefix: str) -> nn.Module:
        return MambaMixer(ctx, prefix, hidden_size=config.hidden_size,
                          intermediate_size=config.intermediate_size,
                          state_size=config.state_size, conv_kernel=config.conv_kernel,
                          dt_rank=int(config.time_step_rank),
                          use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
                          activation=config.hidden_act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.backbone(input_ids, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each stage takes its own layers' tensors; with tied embeddings the last stage
        loads its LM head from the embeddings."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name == "backbone.embeddings.weight":
                if self.tie_word_embeddings and self.pp.size > 1 and self.pp.is_last:
                    self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                    loaded.add("lm_head.weight")
                if not self.pp.is_first:
                    continue
            elif not self.pp.owns(name, num_layers):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
