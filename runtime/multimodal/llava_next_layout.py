"""LLaVA-NeXT's image layout: anyres tiling (the grid of tiles chosen from
`image_grid_pinpoints` for the image's size, plus the whole image resized to one tile), the tiles'
patch grid unpadded back to the image's aspect ratio, and one `image_newline` after each of its
rows. The count of `<image>` tokens therefore depends on each image's size (the image processor's
`image_sizes`); the model (`runtime.models.llava_next`) lays out its embeddings by the same rules.
"""
from __future__ import annotations

from typing import Any

from runtime.multimodal.layout import ImageLayout


def anyres_grid(image_size: list[int], pinpoints: list[list[int]], tile: int) -> tuple[int, int]:
    """The (rows, columns) of tiles of an image of (height, width) `image_size`."""
    from transformers.image_processing_utils import select_best_resolution
    height, width = select_best_resolution(image_size, pinpoints)
    return height // tile, width // tile


def unpadded_size(image_size: list[int], height: int, width: int) -> tuple[int, int]:
    """The part of a (height, width) patch grid the image covers once the padding the image
    processor added around it (to fit the tiles' aspect ratio) is cut away."""
    original_height, original_width = image_size
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        return height - 2 * ((height - new_height) // 2), width
    new_width = int(round(original_width * (height / original_height), 7))
    return height, width - 2 * ((width - new_width) // 2)


def anyres_tokens(image_size: list[int], pinpoints: list[list[int]], tile: int,
                  side: int) -> int:
    """An image's embeddings: the base tile's `side`**2 patches, then its unpadded grid with a
    newline after each row."""
    rows, cols = anyres_grid(image_size, pinpoints, tile)
    height, width = unpadded_size(image_size, rows * side, cols * side)
    return side * side + height * (width + 1)


class LlavaNextLayout(ImageLayout):
    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(hf_config.image_token_id)
        vision = hf_config.vision_config
        self.pinpoints = [list(p) for p in hf_config.image_grid_pinpoints]
        self.tile = vision.image_size
        self.side = vision.image_size // vision.patch_size

    def item(self, out: Any) -> dict[str, Any]:
        return {"pixel_values": out["pixel_values"][0], "image_sizes": out["image_sizes"][0]}

    def num_tokens(self, item: dict[str, Any]) -> int:
        return anyres_tokens(item["image_sizes"].tolist(), self.pinpoints, self.tile, self.side)

    def hf_inputs(self, features: list) -> dict[str, Any]:
        import torch
        items = [f.tensors() for f in features]
        # padded to the most tiles any image can have, so prompts batch (transformers reads
        # each image's own count from its size)
        tiles = 1 + max(h // self.tile * (w // self.tile) for h, w in self.pinpoints)
        pixels = torch.zeros(len(items), tiles, *items[0]["pixel_values"].shape[1:])
        for k, i in enumerate(items):
            pixels[k, :len(i["pixel_values"])] = i["pixel_values"]
        return {"pixel_values": pixels, "image_sizes": torch.stack([i["image_sizes"]
                                                                   for i in items])}
