"""Gemma 3 vision-language (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, Gemma 3's
multimodal projector (the patch grid average-pooled to `mm_tokens_per_image` tokens, a Gemma
RMSNorm, a projection to the text width) and the Gemma 3 text model.

The tokens of one image attend to each other both ways, as transformers' `token_type_ids`
mask has them (`mm_prefix_lm`): the worker hands each step's image runs to the attention
backend (`AttentionMetadata.mm_prefix_ranges`), and the scheduler schedules a run whole.
Checkpoints load with either naming: transformers 5's (`model.vision_tower.*`,
`model.language_model.*`, `lm_head.*`) or the original (`vision_tower.vision_model.*`,
`language_model.model.*`). One rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.clip import vision_activation
from runtime.models.gemma import Gemma3ForCausalLM, gemma_rms_norm
from runtime.models.siglip import SiglipVisionTower
from runtime.models.vlm import VisionLanguageModel



class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or \
                self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} must be a "
                             f"square whose side divides the {self.patches_per_side} patches "
                             f"per side")
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = vision.layer_norm_eps
        self.mm_soft_emb_norm_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size, dtype=ctx.dtype),
            requires_grad=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, mm_tokens_per_image, text hidden]."""
        b, _, d = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(b, d, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = gemma_rms_norm(pooled, self.mm_soft_emb_norm_weight, self.eps)
        return torch.matmul(normed, self.mm_input_projection_weight).to(features.dtype)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    supports_prompt_embeds = True  # a prompt of embeddings carries no image
    mm_prefix_lm = True  # an image's tokens attend to each other both ways

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        vision = config.vision_config
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError("Gemma 3 vision runs on one rank: tensor and pipeline parallel "
                             "size 1")
        if vision.model_type != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {vision.model_type!r} vision tower is not "
                             f"supported; supported: siglip_vision_model")
        vision_activation(vision.hidden_act)  # refuses an activation we do not have
        self.config = config
        self.vision_tower = SiglipVisionTower(vision, ctx)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, ctx)
        self.language_model = Gemma3ForCausalLM(config.text_config, ctx)

    @staticmethod
    def max_tokens_per_item(hf_config) -> int:
        """The placeholder run of one image, which a step must take whole."""
        return hf_config.mm_tokens_per_image

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [mm_tokens_per_image, text hidden]."""
        pixels = torch.stack([item["pixel_values"] for item in items])
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def vision_weight(self, name: str, tensor: torch.Tensor
                      ) -> tuple[str, torch.Tensor] | None:
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        name = name.replace("mm_soft_emb_norm.weight", "mm_soft_emb_norm_weight")
        if name.startswith("vision_tower.head.") or "position_ids" in name:
            return None  # the pooling head: Gemma 3 reads the last hidden states
        return name, tensor
