"""Image content parts of chat messages, as the APIs send them: OpenAI's `image_url`,
Anthropic's `image` block (base64 or url source), the Responses API's `input_image`, vLLM's
`image_embeds` (runtime.multimodal.embeds), and for `LLM.chat` vLLM's `image_pil`. Each
becomes the model's placeholder on a line of its own in the template text, or, for a chat
template that reads a message's content parts (Idefics3's), an `{"type": "image"}` part beside
text parts; the images are collected in order for the processor."""
from __future__ import annotations

from typing import Any, Callable

IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil", "image_embeds")
UNSUPPORTED_PART_TYPES = ("input_audio", "audio_url", "video_url", "video", "file",
                          "input_file")


class ChatImages:
    """`placeholder`: the model's image placeholder text; None for a text-only model, which
    refuses image parts."""

    def __init__(self, placeholder: str | None, as_parts: bool = False) -> None:
        self.placeholder = placeholder
        self.as_parts = as_parts  # the chat template reads content parts
        self.images: list[Any] = []  # URLs (data:, http(s)://, file://) or PIL images

    def content_of(self, content: str | list[Any], text_of: Callable[[list], str]
                   ) -> str | list[dict[str, str]]:
        """A message's content as the chat template reads it: its text (`text_of`), or for a
        template that reads parts, text parts and an `{"type": "image"}` part per image."""
        if not self.as_parts:
            return content if isinstance(content, str) else self.text_of(content, text_of)
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        parts = []
        for part in content:
            image = image_of(part) if isinstance(part, dict) else None
            if image is None:
                parts.append({"type": "text", "text": text_of([part])})
            else:
                self._add(image, part)
                parts.append({"type": "image"})
        return parts

    def text_of(self, content: list[Any], text_of: Callable[[list], str]) -> str:
        """The text of a list of parts, images as placeholders; `text_of` reads text parts.
        ValueError naming a part that cannot be taken."""
        texts = []
        for part in content:
            image = image_of(part) if isinstance(part, dict) else None
            if image is None:
                texts.append(text_of([part]))
                continue
            self._add(image, part)
            texts.append(self.placeholder + "\n")
        return "".join(texts)

    def _add(self, image: Any, part: dict[str, Any]) -> None:
        if self.placeholder is None:
            raise ValueError(f"a {part.get('type')!r} content part was given, but this "
                             "model is text-only: it takes no images")
        self.images.append(image)

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


def template_reads_parts(template: str | None) -> bool:
    """Whether a chat template loops over a message's content (a list of typed parts, as
    Idefics3's, the Qwen-VLs' and LLaVA's do, directly or through a filter such as
    `selectattr`) rather than printing it as a string."""
    import jinja2
    from jinja2 import nodes
    if not isinstance(template, str):
        return False
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getattr) and it.attr == "content" or \
                isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and \
                it.arg.value == "content":
            return True
    return False
