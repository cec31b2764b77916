"""A tool call as the OpenAI API carries it: a function name and its arguments as JSON text."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.structured_output.params import loads_json_text


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the model wrote it where it could be streamed
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def call_of(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from a parsed {"name": ..., <arguments_key> or "arguments": {...}} object (the
    arguments may be JSON text); None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_json_text(arguments, "a tool call's arguments")
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
