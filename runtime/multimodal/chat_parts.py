"""Image content parts of chat messages, as the APIs send them: OpenAI's `image_url`,
Anthropic's `image` block (base64 or url source), the Responses API's `input_image`, vLLM's
`image_embeds` (runtime.multimodal.embeds), and for `LLM.chat` vLLM's `image_pil`. Each
becomes the model's placeholder on a line of its own in the template text; the images are
collected in order for the processor."""
from __future__ import annotations

from typing import Any, Callable

IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil", "image_embeds")
UNSUPPORTED_PART_TYPES = ("input_audio", "audio_url", "video_url", "video", "file",
                          "input_file")


class ChatImages:
    """`placeholder`: the model's image placeholder text; None for a text-only model, which
    refuses image parts."""

    def __init__(self, placeholder: str | None) -> None:
        self.placeholder = placeholder
        self.images: list[Any] = []  # URLs (data:, http(s)://, file://) or PIL images

    def text_of(self, content: list[Any], text_of: Callable[[list], str]) -> str:
        """The text of a list of parts, images as placeholders; `text_of` reads text parts.
        ValueError naming a part that cannot be taken."""
        texts = []
        for part in content:
            image = image_of(part) if isinstance(part, dict) else None
            if image is None:
                texts.append(text_of([part]))
                continue
            if self.placeholder is None:
                raise ValueError(f"a {part.get('type')!r} content part was given, but this "
                                 "model is text-only: it takes no images")
            self.images.append(image)
            texts.append(self.placeholder + "\n")
        return "".join(texts)

    def prompt(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """`prompt` with the collected images as its multi_modal_data."""
        return {**prompt, "multi_modal_data": {"image": self.images}} if self.images else prompt


def image_of(part: dict[str, Any]) -> Any:
    """The image of a content part (a URL string, or a PIL image), None for a part of another
    kind; ValueError for a malformed image part or one of a kind no model here takes."""
    kind = part.get("type")
    if kind in UNSUPPORTED_PART_TYPES:
        raise ValueError(f"a {kind!r} content part was given: audio, video and file parts are "
                         "not supported (text and image parts are)")
    if kind not in IMAGE_PART_TYPES:
        return None
    if kind == "image_pil":
        image = part.get("image_pil")
    elif kind == "image_embeds":  # a tensor (base64), or {"image_embeds", "image_grid_thw"}
        value = part.get("image_embeds")
        image = value if isinstance(value, dict) or value is None or \
            (isinstance(value, str) and not value) else {"image_embeds": value}
    elif kind == "image_url":  # OpenAI: {"image_url": {"url": ...}} (or the URL itself)
        value = part.get("image_url")
        image = value.get("url") if isinstance(value, dict) else value
    elif kind == "input_image":  # Responses: {"image_url": "..."}
        image = part.get("image_url")
    else:  # Anthropic: {"source": {"type": "base64", "media_type", "data"} or {"type": "url"}}
        source = part.get("source") if isinstance(part.get("source"), dict) else {}
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            image = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        else:
            image = source.get("url") if source.get("type") == "url" else None
    if image is None or image == "":
        raise ValueError(f"the {kind!r} content part has no image")
    return image
