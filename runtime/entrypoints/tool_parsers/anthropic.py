"""Anthropic's tools on /v1/messages, in the terms of `ToolChoice`: tools with an
`input_schema`, tool_choice auto / any / tool / none, `tool_use` and `tool_result` blocks."""
from __future__ import annotations

import json
from typing import Any

from runtime.entrypoints.errors import bad_request
from runtime.entrypoints.tool_parsers.tool_choice import ToolChoice


def anthropic_tool_choice(body: Any, parser: str | None, auto_enabled: bool) -> ToolChoice:
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None:
        return ToolChoice(tools, None, parser, auto_enabled)
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('tool_choice of type "tool" needs a name', param="tool_choice")
        return ToolChoice(tools, None, parser, auto_enabled, parallel, named=choice.name)
    kind = {"any": "required"}.get(choice.type, choice.type)
    return ToolChoice(tools, kind, parser, auto_enabled, parallel)


def anthropic_messages(messages: list[Any], text_of) -> list[dict]:
    """Messages as chat templates read them: `tool_use` blocks become the assistant's
    tool_calls, each `tool_result` block a "tool" message, `thinking` blocks its
    reasoning_content."""
    out: list[dict] = []
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": text_of(m.content)})
            continue
        texts = [b for b in m.content if b.get("type") in ("text", "image")]  # images: media
        uses = [b for b in m.content if b.get("type") == "tool_use"]
        results = [b for b in m.content if b.get("type") == "tool_result"]
        thinking = [b for b in m.content if b.get("type") == "thinking"]
        if len(texts) + len(uses) + len(results) + len(thinking) < len(m.content):
            kinds = sorted({str(b.get("type")) for b in m.content} -
                           {"text", "image", "tool_use", "tool_result", "thinking"})
            raise bad_request(f"content blocks of type {', '.join(kinds)} are not supported "
                              "(text, image, thinking, tool_use and tool_result are)",
                              param="messages")
        for block in results:
            content = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": text_of(content)})
        if texts or uses:
            message: dict[str, Any] = {"role": m.role, "content": text_of(texts)}
            if thinking:  # templates read reasoning_content
                message["reasoning_content"] = message["reasoning"] = "".join(
                    str(b.get("thinking", "")) for b in thinking)
            if uses:
                message["tool_calls"] = [{"id": b.get("id"), "type": "function", "function": {
                    "name": b.get("name"), "arguments": b.get("input", {})}} for b in uses]
            out.append(message)
    return out


def content_blocks(message: dict) -> list[dict]:
    """An assistant message (`ToolChoice.message`) as Anthropic content blocks."""
    calls = message.get("tool_calls", [])
    blocks = [{"type": "text", "text": message["content"] or ""}] \
        if message["content"] or not calls else []
    for call in calls:
        blocks.append({"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1),
                       "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks
