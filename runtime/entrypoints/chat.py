"""Conversations to prompt tokens, through the model's chat template (or `--chat-template`)."""
from __future__ import annotations

import os
from typing import Any

from runtime.entrypoints.errors import bad_request
from runtime.multimodal.chat_parts import ChatImages


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
    if not isinstance(content, list):
        raise bad_request(f"content must be a string or a list of text parts, got "
                          f"{type(content).__name__}", param="messages")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise bad_request(f"content parts must be objects such as "
                              f'{{"type": "text", "text": "..."}}, got {type(part).__name__}',
                              param="messages")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"only text content is supported, got a {part.get('type')!r} part",
                              param="messages")
        texts.append(part["text"])
    return "".join(texts)


# apply_chat_template's own parameters: not template variables a request may set
_TEMPLATE_CALL_ARGS = frozenset((
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))


def template_variables(tokenizer: Any, chat_template: str | None) -> set[str]:
    """The variables the chat template reads that it does not set itself."""
    import jinja2
    from jinja2 import meta
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    try:
        return meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return set()


def effort_kwargs(tokenizer: Any, chat_template: str | None, effort: str | None,
                  param: str) -> dict[str, Any]:
    """`reasoning_effort` as a template variable, as vLLM passes it (gpt-oss's template puts
    it in the system message); a 400 naming `param` when the template does not read it."""
    if effort is None:
        return {}
    if "reasoning_effort" not in template_variables(tokenizer, chat_template):
        raise bad_request(f"{param} is not supported for this model: its chat template does "
                          "not read reasoning_effort (it would be ignored)", param=param)
    return {"reasoning_effort": effort}


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts, with "tool_calls" and
    "tool_call_id" where given) rendered with the template, which also renders `tools`; a
    "developer" message is a "system" one unless the template knows that role (as vLLM);
    `continue_final_message` leaves the last message open for the model to go on with (as
    vLLM's field), `template_kwargs` are extra template variables (`chat_template_kwargs`)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: start the server with "
                          "--chat-template, or use /v1/completions", param="messages")
    if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise bad_request("continue_final_message continues the last message, which must be "
                          "the assistant's, and needs add_generation_prompt=false",
                          param="continue_final_message")
    template = chat_template or tokenizer.chat_template
    if isinstance(template, str) and "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m
                    for m in messages]
    reserved = sorted(_TEMPLATE_CALL_ARGS & set(template_kwargs or ()))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}: they are request "
                          "fields or the server's", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             tools=tools, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # a template may raise on roles or orders it does not accept
        raise bad_request(f"the chat template failed on these messages: {e}",
                          param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


class ChatMedia:
    """A conversation's images, collected in order while its messages become template text
    (`runtime.multimodal.chat_parts`); a 400 naming the part for one that cannot be taken.
    `multimodal` is the engine's `MultiModalProcessor`; None for a text-only model. `param`:
    the request field a 400 names; `chat_template`: the server's --chat-template."""

    def __init__(self, multimodal: Any, param: str = "messages",
                 chat_template: str | None = None) -> None:
        self.parts = ChatImages(None) if multimodal is None else \
            ChatImages(multimodal.placeholder, multimodal.chat_parts(chat_template))
        self.param = param

    def text_of(self, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, str]]:
        if not isinstance(content, list) and not self.parts.as_parts:
            return text_of(content)
        try:
            return self.parts.content_of(content or "", text_of)
        except ValueError as e:
            raise bad_request(str(e), param=self.param) from None

    def prompt(self, token_ids: list[int]) -> dict[str, Any]:
        """The engine prompt of the rendered conversation, with its images."""
        return self.parts.prompt({"prompt_token_ids": token_ids})
