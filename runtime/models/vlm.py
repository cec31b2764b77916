"""What every vision-language model here shares: a language model (`language_model`, a
causal LM of ours) that embeds the token ids, runs on the merged text and image embeddings
(`inputs_embeds`) and computes the logits, and the loading of a checkpoint split between the
language model and the rest. A subclass adds the vision tower and its `embed_multimodal`."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.models.llama import default_weight_loader

# checkpoint name part -> (the merged parameter's part, its shard): a vision tower's q, k and v
# load into one qkv_proj
VISION_QKV = {".q_proj.": ("qkv_proj", "q"), ".k_proj.": ("qkv_proj", "k"),
              ".v_proj.": ("qkv_proj", "v")}


class VisionLanguageModel(nn.Module):
    language_model: nn.Module
    vision_prefix = "vision_tower."  # where the merged parameters of `stacked_params` live
    stacked_params: dict[str, tuple[str, str | int]] = VISION_QKV

    def text_weight_name(self, name: str) -> str | None:
        """The language model's name for checkpoint tensor `name` (without a leading
        `model.`), None when it is not the language model's: transformers 5's
        `language_model.*` and the original `language_model.model.*`, and `lm_head.*`."""
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
            return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
        return name if name.startswith("lm_head.") else None

    def vision_weight(self, name: str, tensor: torch.Tensor
                      ) -> tuple[str, torch.Tensor] | None:
        """Our name (and the tensor as we keep it) for a checkpoint tensor outside the
        language model; None for one this model does not build."""
        return name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        text: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            text_name = self.text_weight_name(name)
            if text_name is not None:
                text.append((text_name, tensor))
                continue
            ours = self.vision_weight(name, tensor)
            if ours is None:
                continue
            name, tensor = ours
            part = next((p for p in self.stacked_params if p in name), None)
            if part is not None and name.startswith(self.vision_prefix):
                merged, shard = self.stacked_params[part]
                name = name.replace(part, f".{merged}.")
                params[name].weight_loader(params[name], tensor, shard)
            elif name in params:
                default_weight_loader(params[name], tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            loaded.add(name)
        return loaded | {f"language_model.{n}" for n in self.language_model.load_weights(text)}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)

    def scale_inputs_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.language_model.scale_inputs_embeds(embeds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
