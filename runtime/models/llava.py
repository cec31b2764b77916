"""LLaVA 1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer MLP projector,
and a Llama-family language model whose image placeholders take the projected patch features.

The engine merges the image embeddings (`embed_multimodal`, run through the encoder cache)
into the text embeddings (`embed_input_ids`) and passes them as `inputs_embeds`. Checkpoints
load with either naming: transformers 5's (`model.vision_tower.*`, `model.language_model.*`,
`lm_head.*`) or the original (`vision_tower.vision_model.*`, `language_model.model.*`). One
rank.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.linear import ReplicatedLinear
from runtime.models.clip import CLIPVisionTower, vision_activation
from runtime.models.llama import LlamaForCausalLM, MistralForCausalLM
from runtime.models.vlm import VisionLanguageModel

LANGUAGE_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM}


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, config, ctx: BuildContext) -> None:
        super().__init__()
        hidden = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = ReplicatedLinear(in_features, hidden, bias, ctx)
        self.act = vision_activation(config.projector_hidden_act)
        self.linear_2 = ReplicatedLinear(hidden, hidden, bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    supports_prompt_embeds = True  # a prompt of embeddings carries no image
    language_models = LANGUAGE_MODELS

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError("LLaVA runs on one rank: tensor and pipeline parallel size 1")
        if vision.model_type != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vision.model_type!r} vision tower is not supported; "
                             "supported: clip_vision_model")
        if text.model_type not in self.language_models:
            raise ValueError(f"LLaVA with a {text.model_type!r} language model is not supported; "
                             f"supported: {', '.join(self.language_models)}")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy "
                             f"{config.vision_feature_select_strategy!r} is not supported")
        self.config = config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        num_states = vision.num_hidden_layers + 1  # the embeddings, then each layer's output
        self.feature_layers = [i % num_states for i in layers]
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.vision_tower = CLIPVisionTower(vision, ctx, max(self.feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(layers), config, ctx)
        self.language_model = self.language_models[text.model_type](text, ctx)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [patches (+ CLS with "full"), text hidden]."""
        pixels = torch.stack([item["pixel_values"] for item in items])
        features = torch.cat(self.vision_tower(pixels, self.feature_layers), dim=-1)
        if self.drop_cls:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features))

    def vision_weight(self, name: str, tensor: torch.Tensor
                      ) -> tuple[str, torch.Tensor] | None:
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        if name.startswith("vision_tower.encoder.layers.") and \
                int(name.split(".")[3]) >= len(self.vision_tower.encoder.layers):
            return None  # layers past the deepest feature layer are not built
        if name.startswith("vision_tower.post_layernorm.") or "position_ids" in name:
            return None
        return name, tensor
