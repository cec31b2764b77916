"""RoBERTa and XLM-RoBERTa: BERT's encoder with positions counted from `padding_idx + 1` and a
two-layer classification head on the first token."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.bert import BertModel, load_by_name


class RobertaModel(BertModel):
    checkpoint_prefix = "roberta."

    def __init__(self, config, ctx: BuildContext, add_pooler: bool = False) -> None:
        super().__init__(config, ctx, add_pooler)
        # requests are never padded, so token i sits at padding_idx + 1 + i
        self.position_offset = config.pad_token_id + 1


class RobertaClassificationHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_tokens)))


class RobertaForSequenceClassification(nn.Module):
    """A cross-encoder or classifier (e.g. the bge-reranker layout): `classify` maps each
    request's first-token hidden state to its `num_labels` logits."""

    encoder_only = True

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.roberta = RobertaModel(config, ctx)
        self.classifier = RobertaClassificationHead(config).to(ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.roberta(input_ids, positions, token_type_ids)

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(first_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_by_name(self, weights)


XLMRobertaModel = RobertaModel
XLMRobertaForSequenceClassification = RobertaForSequenceClassification
