"""Mistral 3's image layout (Pixtral's): the image processor resizes each image to a multiple of
patch x `spatial_merge_size` pixels (its own `patch_size` is the vision patch; the model's
merge is applied here, as transformers' PixtralProcessor does), and the image takes a row of
`[IMG]` per merged row of patches, each row closed by `[IMG_BREAK]` and the last by
`[IMG_END]`."""
from __future__ import annotations

from typing import Any

import torch

from runtime.multimodal.inputs import MultiModalFeature
from runtime.multimodal.layout import ImageLayout

BREAK_TOKEN, END_TOKEN = "[IMG_BREAK]", "[IMG_END]"


class Mistral3Layout(ImageLayout):
    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(hf_config.image_token_id)
        self.unit = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
        self.processor_kwargs = {"patch_size": {"height": self.unit, "width": self.unit}}
        ids = tokenizer.convert_tokens_to_ids([BREAK_TOKEN, END_TOKEN])
        if None in ids or tokenizer.unk_token_id in ids:
            raise ValueError(f"the tokenizer lacks Mistral 3's {BREAK_TOKEN} or {END_TOKEN}")
        self.break_id, self.end_id = ids

    def grid(self, image_sizes: list[int]) -> tuple[int, int]:
        return image_sizes[0] // self.unit, image_sizes[1] // self.unit

    def item(self, out: Any) -> dict[str, Any]:
        # the break and end ids ride along: the encoder's output holds their embeddings
        return {"pixel_values": out["pixel_values"][0], "image_sizes": out["image_sizes"][0],
                "special_ids": torch.tensor([self.break_id, self.end_id])}

    def num_tokens(self, item: dict[str, Any]) -> int:
        rows, cols = self.grid(item["image_sizes"].tolist())
        return rows * (cols + 1)

    def placeholder_ids(self, feature: MultiModalFeature) -> list[int]:
        rows, cols = self.grid(feature.data["image_sizes"].tensor().tolist())
        ids = ([self.placeholder_token_id] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids

    def hf_inputs(self, features: list[MultiModalFeature]) -> dict[str, Any]:
        items = [f.tensors() for f in features]
        height = max(int(i["image_sizes"][0]) for i in items)
        width = max(int(i["image_sizes"][1]) for i in items)
        pixels = torch.zeros(len(items), items[0]["pixel_values"].size(0), height, width)
        for k, i in enumerate(items):
            h, w = i["image_sizes"].tolist()
            pixels[k, :, :h, :w] = i["pixel_values"][:, :h, :w]
        return {"pixel_values": pixels, "image_sizes": torch.stack([i["image_sizes"]
                                                                   for i in items])}
