"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA whose images are tiled (anyres).

Each image arrives as its base tile (the whole image resized) and the tiles of the grid chosen
from `image_grid_pinpoints`; all tiles go through the CLIP tower and projector in one batch.
An image's embeddings are the base tile's patches, then the tiles' patches as one grid cut back
to the image's aspect ratio with the learned `image_newline` after each row
(`runtime.multimodal.llava_next_layout` gives the same count to the prompt). Language models:
Llama, Mistral, Qwen2. One rank.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.build_context import BuildContext
from runtime.models.llava import LANGUAGE_MODELS, LlavaForConditionalGeneration
from runtime.models.qwen import Qwen2ForCausalLM
from runtime.multimodal.llava_next_layout import anyres_grid, unpadded_size


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    language_models = {**LANGUAGE_MODELS, "qwen2": Qwen2ForCausalLM}

    def __init__(self, config, ctx: BuildContext) -> None:
        if config.vision_feature_select_strategy != "default":
            # with "full" each tile's CLS would have to sit in the patch grid, which
            # transformers cannot lay out either
            raise ValueError(f"LLaVA-NeXT with vision_feature_select_strategy "
                             f"{config.vision_feature_select_strategy!r} is not supported; "
                             "supported: default")
        super().__init__(config, ctx)
        vision = config.vision_config
        self.pinpoints = [list(p) for p in config.image_grid_pinpoints]
        self.side = vision.image_size // vision.patch_size
        self.image_newline = nn.Parameter(
            torch.empty(config.text_config.hidden_size, dtype=ctx.dtype), requires_grad=False)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [base patches + rows * (columns + 1), text hidden]."""
        pixels = torch.cat([item["pixel_values"] for item in items])
        features = torch.cat(self.vision_tower(pixels, self.feature_layers), dim=-1)[:, 1:]
        tiles = self.multi_modal_projector(features).split(
            [len(item["pixel_values"]) for item in items])
        return [self.pack(t, item["image_sizes"].tolist()) for t, item in zip(tiles, items)]

    def pack(self, tiles: torch.Tensor, image_size: list[int]) -> torch.Tensor:
        """[tiles, side**2, hidden] of one image -> its embeddings in prompt order."""
        side, dim = self.side, tiles.size(-1)
        rows, cols = anyres_grid(image_size, self.pinpoints, self.config.vision_config.image_size)
        grid = tiles[1:].view(rows, cols, side, side, dim).permute(0, 2, 1, 3, 4).reshape(
            rows * side, cols * side, dim)
        height, width = unpadded_size(image_size, rows * side, cols * side)
        top, left = (rows * side - height) // 2, (cols * side - width) // 2
        grid = grid[top:top + height, left:left + width]
        newline = self.image_newline.to(grid.dtype).expand(height, 1, dim)
        return torch.cat([tiles[0], torch.cat([grid, newline], dim=1).reshape(-1, dim)])
