"""Token embedding and LM head, split over tensor-parallel ranks along the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.quantization.base import UnquantizedLinearMethod
from runtime.layers.build_context import BuildContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = ctx.tp_rank, ctx.tp_size, ctx.tp_group
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // ctx.tp_size)
        self.vocab_start = self.shard_size * ctx.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=ctx.dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[:shard.size(0)].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        return self.tp_group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits (float32, full vocabulary on every rank).
    The product is a dense linear layer's, so a platform's "linear" kernel computes it."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext) -> None:
        super().__init__(vocab_size, hidden_size, ctx)
        self.method = UnquantizedLinearMethod(ctx.custom_op("linear"))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden)
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size].float()
