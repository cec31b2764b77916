"""Mistral 3 (`Mistral3ForConditionalGeneration`): the Pixtral vision encoder at each image's
own size, a projector (RMSNorm, the patch merger that folds each `spatial_merge_size` square of
patches into one, two linears) and a Mistral/Llama language model.

An image takes a row of `[IMG]` tokens per merged row of patches, each row closed by
`[IMG_BREAK]` and the last by `[IMG_END]` (`runtime.multimodal.mistral3_layout`). The encoder's
output for an image covers that whole run: the break and end rows hold those tokens' own text
embeddings, so the engine merges an image as one item. Checkpoints load with transformers 5's
naming (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*`) or the older one (`vision_tower.*`, `language_model.model.*`). One rank.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import ReplicatedLinear
from runtime.models.clip import vision_activation
from runtime.models.llama import LlamaForCausalLM, MistralForCausalLM
from runtime.models.pixtral import PixtralVisionModel
from runtime.models.vlm import VisionLanguageModel

LANGUAGE_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM}
STACKED = {".q_proj.": ("qkv_proj", "q"), ".k_proj.": ("qkv_proj", "k"),
           ".v_proj.": ("qkv_proj", "v"), ".gate_proj.": ("gate_up_proj", 0),
           ".up_proj.": ("gate_up_proj", 1)}


class Mistral3PatchMerger(nn.Module):
    """Each `merge` x `merge` square of an image's patches side by side, through one linear."""

    def __init__(self, dim: int, merge: int, ctx: BuildContext) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = ReplicatedLinear(dim * merge ** 2, dim, False, ctx)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        m, dim = self.merge, x.size(-1)
        squares = [image.view(h // m, m, w // m, m, dim).permute(0, 2, 4, 1, 3).reshape(
            -1, dim * m * m) for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids)]
        return self.merging_layer(torch.cat(squares))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        dim, hidden = config.vision_config.hidden_size, config.text_config.hidden_size
        bias = config.multimodal_projector_bias
        self.norm = RMSNorm(dim, config.text_config.rms_norm_eps, ctx)
        self.patch_merger = Mistral3PatchMerger(dim, config.spatial_merge_size, ctx)
        self.linear_1 = ReplicatedLinear(dim, hidden, bias, ctx)
        self.act = vision_activation(config.projector_hidden_act)
        self.linear_2 = ReplicatedLinear(hidden, hidden, bias, ctx)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        x = self.patch_merger(self.norm(x), grids)
        return self.linear_2(self.act(self.linear_1(x)))


class Mistral3ForConditionalGeneration(VisionLanguageModel):
    supports_prompt_embeds = True  # a prompt of embeddings carries no image

    def __init__(self, config, ctx: BuildContext) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        if ctx.tp_size > 1 or ctx.pp.size > 1:
            raise ValueError("Mistral 3 runs on one rank: tensor and pipeline parallel size 1")
        if vision.model_type != "pixtral":
            raise ValueError(f"Mistral 3 with a {vision.model_type!r} vision tower is not "
                             "supported; supported: pixtral")
        if text.model_type not in LANGUAGE_MODELS:
            raise ValueError(f"Mistral 3 with a {text.model_type!r} language model is not "
                             f"supported; supported: {', '.join(LANGUAGE_MODELS)}")
        if not isinstance(config.vision_feature_layer, int):
            # the projector's norm is over one layer's width (so is transformers')
            raise ValueError(f"Mistral 3 with vision_feature_layer "
                             f"{config.vision_feature_layer!r} is not supported; supported: "
                             "one layer index")
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_size = vision.patch_size
        num_layers = config.vision_feature_layer % (vision.num_hidden_layers + 1)
        self.vision_tower = PixtralVisionModel(vision, ctx, num_layers)
        self.multi_modal_projector = Mistral3MultiModalProjector(config, ctx)
        text = copy.copy(text)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model = LANGUAGE_MODELS[text.model_type](text, ctx)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [rows * (columns + 1), text hidden]: its merged patches
        row by row, then [IMG_BREAK]'s embedding after each row ([IMG_END]'s after the last)."""
        sizes = [item["image_sizes"].tolist() for item in items]
        features = self.vision_tower([item["pixel_values"] for item in items], sizes)
        grids = [(h // self.patch_size, w // self.patch_size) for h, w in sizes]
        merged = self.multi_modal_projector(features, grids).split(
            [h * w // self.merge ** 2 for h, w in grids])
        out = []
        for image, (h, w), item in zip(merged, grids, items):
            rows, cols = h // self.merge, w // self.merge
            brk, end = self.embed_input_ids(item["special_ids"]).to(image.dtype)
            run = torch.cat([image.view(rows, cols, -1), brk.expand(rows, 1, -1)], dim=1)
            run = run.reshape(rows * (cols + 1), -1)
            run[-1] = end
            out.append(run)
        return out

    stacked_params = STACKED

    def vision_weight(self, name: str, tensor: torch.Tensor
                      ) -> tuple[str, torch.Tensor] | None:
        if name.startswith("vision_tower.transformer.layers.") and \
                int(name.split(".")[3]) >= len(self.vision_tower.transformer.layers):
            return None  # layers past the feature layer are not built
        if name == "vision_tower.patch_conv.weight":  # stride = kernel: a matmul
            tensor = tensor.reshape(tensor.size(0), -1)
        return name, tensor
