"""Conversations to prompt tokens, through the model's chat template (or `--chat-template`)."""
from __future__ import annotations

import os
from typing import Any

from runtime.entrypoints.errors import bad_request


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def text_of(content: str | list[dict[str, Any]] | None) -> str:
    """The text of a message's content: a string, or a list of text parts (OpenAI's
    {"type": "text", "text": ...} and Anthropic's text blocks alike)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"only text content is supported, got a {part.get('type')!r} part",
                              param="messages")
        texts.append(part["text"])
    return "".join(texts)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts, with "tool_calls" and
    "tool_call_id" where given) rendered with the template, which also renders `tools`."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: start the server with "
                          "--chat-template, or use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools, tokenize=False)
    except Exception as e:  # a template may raise on roles or orders it does not accept
        raise bad_request(f"the chat template failed on these messages: {e}",
                          param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
