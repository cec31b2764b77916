"""How Idefics3 and SmolVLM lay an image into the prompt: the image processor cuts it into
`rows` x `cols` tiles plus the global image (or the global image alone), and its `<image>`
becomes, per tile, `<fake_token_around_image><row_r_col_c>` and `image_seq_len` `<image>`s (a
newline after each row), then `\\n<fake_token_around_image><global-img>`, the global image's
`<image>`s and `<fake_token_around_image>`, as transformers' Idefics3Processor writes it. The
run is tokenized by the model's tokenizer; the item holds its token ids and all its tiles.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.multimodal.inputs import MultiModalFeature
from runtime.multimodal.layout import ImageLayout

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
IMAGE_TOKEN = "<image>"


def image_prompt_text(rows: int, cols: int, image_seq_len: int) -> str:
    """The text an image of `rows` x `cols` tiles (0 x 0: not split) takes in the prompt."""
    image = IMAGE_TOKEN * image_seq_len
    text = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
                   + "\n" for r in range(rows))
    return text + ("\n" if rows else "") + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image}{FAKE_TOKEN}"


class Idefics3Layout(ImageLayout):
    processor_kwargs = {"return_row_col_info": True}

    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(hf_config.image_token_id, prompt_text=IMAGE_TOKEN)
        self.patch_size = hf_config.vision_config.patch_size
        self.scale_factor = hf_config.scale_factor
        self.tokenizer = tokenizer

    def item(self, out: Any) -> dict[str, Any]:
        pixels = out["pixel_values"][0]
        padded = "pixel_attention_mask" in out and not bool(out["pixel_attention_mask"].all())
        height, width = pixels.shape[-2:]
        side = height // self.patch_size
        if height != width or side % self.scale_factor or padded:
            raise ValueError(f"the image processor gave {height}x{width} tiles"
                             f"{' with padding' if padded else ''}: the vision model "
                             f"takes square tiles without padding whose patch grid "
                             f"({self.patch_size}-pixel patches) scale_factor "
                             f"{self.scale_factor} divides")
        # a tile's tokens: its patches, pixel-shuffled (transformers' image_seq_len)
        image_seq_len = (side // self.scale_factor) ** 2
        text = image_prompt_text(out["rows"][0][0], out["cols"][0][0], image_seq_len)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"pixel_values": pixels, "input_ids": torch.tensor(ids, dtype=torch.long)}

    def num_tokens(self, item: dict[str, Any]) -> int:
        return len(item["input_ids"])

    def placeholder_ids(self, feature: MultiModalFeature) -> list[int]:
        return feature.data["input_ids"].tensor().tolist()

    def hf_inputs(self, features: list[MultiModalFeature]) -> dict[str, Any]:
        # one tile per row: transformers takes [rows, tiles, ...] and flattens the two, so
        # prompts with different numbers of tiles concatenate
        pixels = torch.cat([f.tensors()["pixel_values"] for f in features])[:, None]
        return {"pixel_values": pixels,
                "pixel_attention_mask": torch.ones(pixels.shape[:2] + pixels.shape[-2:],
                                                   dtype=torch.long)}
