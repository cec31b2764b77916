"""The API process's side of a multimodal prompt: each item through the model's own
transformers image processor (its PIL backend: torchvision is never needed), the prompt's
placeholder token expanded to the item's embedding length, and the item's place and content
hash recorded as a `MultiModalFeature`.

The per-architecture part (which token is the placeholder, how many embeddings an item gives)
is a small `ImageLayout` (`runtime.multimodal.layout`); processed items are kept by content hash, so a repeated image is
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
from runtime.multimodal.layout import Gemma3Layout, ImageLayout, QwenVLLayout, llava_layout
from runtime.multimodal.media import MediaError, MediaPolicy, load_image

DEFAULT_ITEMS_PER_PROMPT = 999  # vLLM's default limit per modality
PROCESSED_CACHE_ITEMS = 256


def llava_next_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.llava_next_layout import LlavaNextLayout
    return LlavaNextLayout(hf_config, tokenizer)


def mistral3_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.mistral3_layout import Mistral3Layout
    return Mistral3Layout(hf_config, tokenizer)


def idefics3_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.idefics3_layout import Idefics3Layout
    return Idefics3Layout(hf_config, tokenizer)


def gemma4_layout(hf_config: Any, tokenizer: Any) -> ImageLayout:
    from runtime.multimodal.gemma4_layout import Gemma4Layout
    return Gemma4Layout(hf_config, tokenizer)


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
           "Gemma3ForConditionalGeneration": Gemma3Layout,
           "Gemma4ForConditionalGeneration": gemma4_layout}


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
