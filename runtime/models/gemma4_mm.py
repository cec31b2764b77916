"""Gemma 4 vision-language (`Gemma4ForConditionalGeneration`), images only: the Gemma 4 vision
encoder and its embedder (`runtime/models/gemma4_vision.py`) before the Gemma 4 text model.

What transformers does at an image's tokens, we do: the per-layer embeddings look up the
pad token there (the image token's own row is never read), while their projection part
reads the merged embeddings (the image's). With `use_bidirectional_attention == "vision"`
an image's tokens attend to each other both ways in the sliding-window layers only (the
global layers stay causal): the model declares `mm_prefix_lm`, the worker hands each step's
image runs to the attention backend, the global layers' `Attention` opts out of them, and
the scheduler schedules a run whole. Audio and video are refused. One rank.
"""
from __future__ import annotations

import json
import os

import torch

from runtime.layers.build_context import BuildContext
from runtime.models.gemma4 import Gemma4ForCausalLM
from runtime.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionModel
from runtime.models.vlm import VisionLanguageModel

LARGEST_MAX_SOFT_TOKENS = 1120  # the most the Gemma 4 image processor allows


class Gemma4ForConditionalGeneration(VisionLanguageModel):
    stacked_params: dict[str, tuple[str, str | int]] = {}  # its tower keeps q, k, v apart
    supports_prompt_embeds = False  # its per-layer embeddings are looked up by token id
    mm_prefix_lm = True  # the sliding layers may attend both ways within an image

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        text = config.text_config
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError("Gemma 4 vision runs on one rank: tensor and pipeline parallel "
                             "size 1")
        if getattr(config, "audio_config", None) is not None:
            raise ValueError("Gemma 4 with an audio tower is not supported (images only): "
                             "its audio encoder is not implemented")
        if config.vision_config is None:
            raise ValueError("Gemma 4 without a vision tower: run it as Gemma4ForCausalLM")
        if text.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"Gemma 4 use_bidirectional_attention "
                             f"{text.use_bidirectional_attention!r} (every token both ways) is "
                             f"not supported; supported: None, 'vision'")
        self.config = config
        self.image_token_id = config.image_token_id
        self.pad_token_id = text.pad_token_id
        self.vision_tower = Gemma4VisionModel(config.vision_config, ctx)
        self.embed_vision = Gemma4MultimodalEmbedder(config.vision_config, text, ctx)
        self.language_model = Gemma4ForCausalLM(text, ctx)

    @staticmethod
    def max_tokens_per_item(hf_config) -> int:
        """The longest placeholder run of one image, which a step must take whole: the image
        processor's `max_soft_tokens`, from the model folder's preprocessor_config.json (280,
        the processor's default, when it names none; the largest allowed without the file)."""
        path = os.path.join(getattr(hf_config, "_name_or_path", "") or "",
                            "preprocessor_config.json")
        if not os.path.isfile(path):
            return LARGEST_MAX_SOFT_TOKENS
        with open(path) as f:
            return int(json.load(f).get("max_soft_tokens", 280))

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [its soft tokens, text hidden]."""
        pooled = self.vision_tower([item["pixel_values"] for item in items],
                                   [item["image_position_ids"] for item in items])
        return [self.embed_vision(p) for p in pooled]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # image tokens take the pad token's per-layer embedding, as in transformers
        ids = torch.where(input_ids == self.image_token_id, self.pad_token_id, input_ids)
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model.model(ids, positions, intermediate, inputs_embeds)
