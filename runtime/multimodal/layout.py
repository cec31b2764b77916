"""How each architecture lays an image into the prompt (`ImageLayout` and the layouts of
LLaVA, the Qwen-VL models and Gemma 3; the larger ones have modules of their own:
`llava_next_layout`, `mistral3_layout`, `idefics3_layout`)."""
from __future__ import annotations

from typing import Any

from runtime.multimodal.inputs import MultiModalFeature


class ImageLayout:
    """How one architecture lays an image into the prompt: its placeholder token (and the
    text a chat image part becomes), what of the image processor's output an item keeps,
    and how many embeddings it gives. LLaVA's: a fixed count per image."""

    mrope = False  # the model's positions are M-RoPE's (runtime.multimodal.mrope)
    processor_kwargs: dict[str, Any] = {}  # what the image processor is called with
    # the tokens put before and after each image's placeholder run (Gemma 3: its begin- and
    # end-of-image tokens), and the prompt token that marks where an image goes (None: the
    # placeholder token itself)
    run_prefix: list[int] = []
    run_suffix: list[int] = []
    prompt_token_id: int | None = None

    def __init__(self, placeholder_token_id: int, tokens_per_image: int = 0,
                 prompt_text: str | None = None) -> None:
        self.placeholder_token_id = placeholder_token_id
        self.tokens_per_image = tokens_per_image
        self.prompt_text = prompt_text  # None: the placeholder token itself

    def item(self, out: Any) -> dict[str, Any]:
        """The processor's output for one image, as the encoder reads it."""
        return {"pixel_values": out["pixel_values"][0]}

    def num_tokens(self, item: dict[str, Any]) -> int:
        return self.tokens_per_image

    def placeholder_ids(self, feature: MultiModalFeature) -> list[int]:
        """The prompt's tokens for the item: its placeholder, once per embedding."""
        return [self.placeholder_token_id] * feature.length

    def mrope_grid(self, item: dict[str, Any]) -> list[int] | None:
        """The item's (t, h, w) in M-RoPE positions; None for a model without M-RoPE."""
        return None

    def hf_inputs(self, features: list[MultiModalFeature]) -> dict[str, Any]:
        """What transformers' model takes for a prompt's items (the bench's reference), each
        tensor batched on dim 0 (prompts concatenate)."""
        import torch
        return {"pixel_values": torch.stack([f.tensors()["pixel_values"] for f in features])}


class QwenVLLayout(ImageLayout):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: an image takes as many tokens as it has merge units (its
    `image_grid_thw`, from its size), between <|vision_start|> and <|vision_end|>."""

    mrope = True

    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        ids = (hf_config.vision_start_token_id, hf_config.image_token_id,
               hf_config.vision_end_token_id)
        super().__init__(hf_config.image_token_id,
                         prompt_text="".join(tokenizer.convert_ids_to_tokens(list(ids))))
        self.merge = hf_config.vision_config.spatial_merge_size

    def item(self, out: Any) -> dict[str, Any]:
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}

    def num_tokens(self, item: dict[str, Any]) -> int:
        return int(item["image_grid_thw"].prod()) // self.merge ** 2

    def mrope_grid(self, item: dict[str, Any]) -> list[int]:
        t, h, w = item["image_grid_thw"].tolist()
        return [t, h // self.merge, w // self.merge]

    def hf_inputs(self, features: list[MultiModalFeature]) -> dict[str, Any]:
        import torch
        items = [f.tensors() for f in features]
        return {"pixel_values": torch.cat([i["pixel_values"] for i in items]),
                "image_grid_thw": torch.stack([i["image_grid_thw"] for i in items])}


class Gemma3Layout(ImageLayout):
    """Gemma 3: a prompt's <start_of_image> becomes "\\n\\n", <start_of_image>,
    `mm_tokens_per_image` <image_soft_token>s, <end_of_image>, "\\n\\n", as its processor
    writes it; images are resized to the tower's size (pan and scan is refused)."""

    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        boi = tokenizer.convert_ids_to_tokens(hf_config.boi_token_index)
        super().__init__(hf_config.image_token_index, hf_config.mm_tokens_per_image, boi)
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.prompt_token_id = hf_config.boi_token_index
        self.run_prefix = newlines + [hf_config.boi_token_index]
        self.run_suffix = [hf_config.eoi_token_index] + newlines

    def item(self, out: Any) -> dict[str, Any]:
        if "num_crops" in out and int(out["num_crops"][0]):
            raise ValueError("Gemma 3 pan and scan (do_pan_and_scan) is not supported: "
                             "turn it off in the image processor's config")
        return super().item(out)


def llava_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    vision = hf_config.vision_config
    num_patches = (vision.image_size // vision.patch_size) ** 2
    full = hf_config.vision_feature_select_strategy == "full"  # "default" drops CLS
    return ImageLayout(hf_config.image_token_id, num_patches + int(full))
