"""What every vision-language model here shares: a language model (`language_model`, a
causal LM of ours) that embeds the token ids, runs on the merged text and image embeddings
(`inputs_embeds`) and computes the logits. A subclass adds the vision tower, its
`embed_multimodal` and `load_weights`."""
from __future__ import annotations

import torch
from torch import nn


class VisionLanguageModel(nn.Module):
    language_model: nn.Module

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)

    def scale_inputs_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.language_model.scale_inputs_embeds(embeds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
