"""Tool-call parsers: text in, (content left over, calls) out."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        return call if index is None else {"index": index, **call}


class ToolParser:
    """Finds the calls a model wrote in its own format; text it cannot read stays content."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in `text` (separated by whitespace, ';' or ','); [] if any
    part is not JSON."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        values.append(value)


class HermesParser(ToolParser):
    """Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number."""

    name = "hermes"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for body in self.BLOCK.findall(text):
            values = _json_values(body)
            call = _call(values[0], "arguments") if len(values) == 1 else None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.find("<tool_call>")].strip() if calls else text
        return content or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x: optional <|python_tag|>, then {"name": ..., "parameters": {...}} objects
    separated by ';'."""

    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(v, "parameters") for v in _json_values(body)]
        if not calls or None in calls:
            return text, []
        return None, calls


class MistralParser(ToolParser):
    """Mistral: [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.MARK not in text:
            return text, []
        content, _, body = text.partition(self.MARK)
        values = _json_values(body.strip())
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        calls = [_call(v, "arguments") for v in items]
        if not calls or None in calls:
            return text, []
        return content.strip() or None, calls


class PythonicParser(ToolParser):
    """Llama 3.2 / 4 pythonic: [get_weather(city="Paris"), now()], literal arguments only."""

    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return text, []
            calls.append(ToolCall(node.func.id, arguments))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def forced_call_schema(tools: list[dict], choice: str | None) -> dict:
    """The JSON schema a forced output follows: the named function's parameters, or (choice
    None: "required") a non-empty list of {"name", "parameters"} calls of any tool."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice is not None:
        return functions[choice].get("parameters") or {"type": "object"}
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name},
                                          "parameters": f.get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, f in functions.items()]}}


def forced_calls(text: str, choice: str | None) -> list[ToolCall]:
    """The calls in an output that followed `forced_call_schema`; [] when it was cut short."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice is not None:
        return [ToolCall(choice, value)] if isinstance(value, dict) else []
    calls = [_call(v, "parameters") for v in value] if isinstance(value, list) else []
    return [] if None in calls else calls
