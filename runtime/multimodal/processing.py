"""The API process's side of a multimodal prompt: each item through the model's own
transformers image processor (its PIL backend: torchvision is never needed), the prompt's
placeholder token expanded to the item's embedding length, and the item's place and content
hash recorded as a `MultiModalFeature`.

The per-architecture part (which token is the placeholder, how many embeddings an item gives)
is a small `ImageLayout`; processed items are kept by content hash, so a repeated image is
processed once.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgspec

from runtime.multimodal.embeds import embeds_feature, embeds_width, image_items, is_embeds_item
from runtime.multimodal.chat_parts import template_reads_parts
from runtime.multimodal.inputs import MultiModalFeature, TensorData
from runtime.multimodal.media import MediaError, MediaPolicy, load_image

DEFAULT_ITEMS_PER_PROMPT = 999  # vLLM's default limit per modality
PROCESSED_CACHE_ITEMS = 256


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


def llava_next_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.llava_next_layout import LlavaNextLayout
    return LlavaNextLayout(hf_config, tokenizer)


def mistral3_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.mistral3_layout import Mistral3Layout
    return Mistral3Layout(hf_config, tokenizer)


def idefics3_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.idefics3 import Idefics3Layout
    return Idefics3Layout(hf_config, tokenizer)


LAYOUTS = {"LlavaForConditionalGeneration": llava_layout,
           "LlavaNextForConditionalGeneration": llava_next_layout,
           "Mistral3ForConditionalGeneration": mistral3_layout,
           "Qwen2VLForConditionalGeneration": QwenVLLayout,
           "Qwen2_5_VLForConditionalGeneration": QwenVLLayout,
           "Qwen3VLForConditionalGeneration": QwenVLLayout,
           "Qwen3_5ForConditionalGeneration": QwenVLLayout,
           "Qwen3_5MoeForConditionalGeneration": QwenVLLayout,
           "Idefics3ForConditionalGeneration": idefics3_layout,
           "SmolVLMForConditionalGeneration": idefics3_layout,
           "Gemma3ForConditionalGeneration": Gemma3Layout}


def is_multimodal_architecture(architecture: str) -> bool:
    return architecture in LAYOUTS


class MultiModalProcessor:
    """`limits`: the most items of each modality one prompt may hold (--limit-mm-per-prompt);
    `enable_mm_embeds`: whether an image may be given as its embeddings
    (runtime.multimodal.embeds)."""

    def __init__(self, model_path: str, hf_config: Any, tokenizer: Any,
                 limits: dict[str, int] | None = None,
                 policy: MediaPolicy = MediaPolicy(), enable_mm_embeds: bool = False) -> None:
        from transformers import AutoImageProcessor
        architecture = hf_config.architectures[0]
        self.layout = LAYOUTS[architecture](hf_config, tokenizer)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        # the text an image takes in a prompt (a chat image part becomes it)
        self.placeholder = self.layout.prompt_text or tokenizer.convert_ids_to_tokens(
            self.layout.placeholder_token_id)
        self.limits = {"image": DEFAULT_ITEMS_PER_PROMPT, **(limits or {})}
        self.policy = policy
        self.enable_mm_embeds = enable_mm_embeds
        self.embeds_width = embeds_width(hf_config)
        self._template_reads_parts = template_reads_parts(
            getattr(tokenizer, "chat_template", None))
        self._processed: OrderedDict[str, MultiModalFeature] = OrderedDict()
        self.num_processed_hits = 0

    def chat_parts(self, chat_template: str | None = None) -> bool:
        """Whether chat image parts reach the chat template (`chat_template`, else the
        tokenizer's) as {"type": "image"} parts: when it reads a message's content parts."""
        return self._template_reads_parts if chat_template is None else \
            template_reads_parts(chat_template)

    def process(self, token_ids: list[int], mm_data: dict[str, Any]
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each placeholder expanded, and its items in prompt order. Raises
        ValueError (MediaError for the media) naming what is wrong."""
        if not isinstance(mm_data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, "
                             f"got {type(mm_data).__name__}")
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data has {', '.join(map(repr, unknown))}, which this "
                             f"model cannot take; it takes: 'image'")
        images = mm_data.get("image")
        if images is None:
            return token_ids, []
        images = image_items(images)
        if len(images) > self.limits["image"]:
            raise ValueError(f"the prompt has {len(images)} images, more than the "
                             f"{self.limits['image']} allowed (--limit-mm-per-prompt)")
        placeholder_id = self.layout.placeholder_token_id
        marker = placeholder_id if self.layout.prompt_token_id is None else \
            self.layout.prompt_token_id
        positions = [i for i, t in enumerate(token_ids) if t == marker]
        if len(positions) != len(images):
            raise ValueError(f"the prompt has {len(positions)} image placeholders "
                             f"({self.placeholder!r}) for {len(images)} images: put one "
                             f"{self.placeholder!r} where each image goes")
        expanded: list[int] = []
        features = []
        last = 0
        for k, (pos, item) in enumerate(zip(positions, images)):
            expanded += token_ids[last:pos] + self.layout.run_prefix
            try:
                feature = embeds_feature(item, self.layout, self.embeds_width,
                                         self.enable_mm_embeds) if is_embeds_item(item) \
                    else self._processed_image(load_image(item, self.policy))
            except MediaError as e:
                raise MediaError(f"image {k}: {e}", e.status) from None
            features.append(msgspec.structs.replace(feature, offset=len(expanded)))
            expanded += self.layout.placeholder_ids(feature) + self.layout.run_suffix
            last = pos + 1
        return expanded + token_ids[last:], features

    def _processed_image(self, image: Any) -> MultiModalFeature:
        """The image as an item at offset 0."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{type(self.image_processor).__name__}:{image.mode}:{image.size}".encode())
        h.update(image.tobytes())
        identifier = h.hexdigest()
        feature = self._processed.get(identifier)
        if feature is not None:
            self._processed.move_to_end(identifier)
            self.num_processed_hits += 1
            return feature
        item = self.layout.item(self.image_processor(images=[image], return_tensors="pt",
                                                      **self.layout.processor_kwargs))
        feature = MultiModalFeature(
            "image", identifier, 0, self.layout.num_tokens(item),
            {name: TensorData.of(t) for name, t in item.items()}, self.layout.mrope_grid(item))
        self._processed[identifier] = feature
        if len(self._processed) > PROCESSED_CACHE_ITEMS:
            self._processed.popitem(last=False)
        return feature


def build_multimodal_processor(config: Any, source: Any, hf_config: Any,
                               tokenizer: Any) -> MultiModalProcessor | None:
    """The processor of a multimodal model served from a folder; None for a text-only one."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures or not is_multimodal_architecture(architectures[0]):
        return None
    policy = MediaPolicy(tuple(config.allowed_media_domains), config.allowed_local_media_path)
    return MultiModalProcessor(source.path, hf_config, tokenizer, config.limit_mm_per_prompt,
                               policy, config.enable_mm_embeds)
