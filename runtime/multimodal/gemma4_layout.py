"""How Gemma 4 lays an image into the prompt: its image processor resizes the image (aspect
kept) to at most `max_soft_tokens` pooled squares of patches, and the prompt's image token
becomes what transformers' processor writes: the begin-of-image token, one image token per
soft token (`num_soft_tokens_per_image`), the end-of-image token. An item keeps the image's
real patches and their (x, y) places, the processor's padding dropped."""
from __future__ import annotations

from typing import Any

from runtime.multimodal.inputs import MultiModalFeature
from runtime.multimodal.layout import ImageLayout


class Gemma4Layout(ImageLayout):
    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        image = tokenizer.convert_ids_to_tokens(hf_config.image_token_id)
        super().__init__(hf_config.image_token_id, prompt_text=image)
        self.run_prefix = [hf_config.boi_token_id]
        self.run_suffix = [hf_config.eoi_token_id]
        self.pooled = hf_config.vision_config.pooling_kernel_size ** 2

    def item(self, out: Any) -> dict[str, Any]:
        positions = out["image_position_ids"][0]
        real = int((positions >= 0).all(-1).sum())  # the padding follows the patches
        return {"pixel_values": out["pixel_values"][0, :real],
                "image_position_ids": positions[:real]}

    def num_tokens(self, item: dict[str, Any]) -> int:
        return item["pixel_values"].size(0) // self.pooled

    def hf_inputs(self, features: list[MultiModalFeature]) -> dict[str, Any]:
        """The items padded to the longest (padding patches at (-1, -1)), as the processor
        pads them."""
        import torch
        items = [f.tensors() for f in features]
        longest = max(i["pixel_values"].size(0) for i in items)
        pixels, positions = [], []
        for i in items:
            pad = longest - i["pixel_values"].size(0)
            pixels.append(torch.nn.functional.pad(i["pixel_values"], (0, 0, 0, pad)))
            positions.append(torch.nn.functional.pad(i["image_position_ids"], (0, 0, 0, pad),
                                                     value=-1))
        return {"pixel_values": torch.stack(pixels), "image_position_ids": torch.stack(positions)}
