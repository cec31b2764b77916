"""Tool-call parsers, one per model family's format: text in, (content left over, calls) out."""
from __future__ import annotations

import ast
import json
from typing import Any

from runtime.entrypoints.tool_parsers.calls import ToolCall, call_of
from runtime.entrypoints.tool_parsers.streaming import CallReader, HermesReader, WholeReader
from runtime.structured_output.params import MAX_JSON_DEPTH, json_depth


class ToolParser:
    """Finds the calls a model wrote in its own format; text it cannot read stays content.
    `reader` reads an output as it streams; a format only readable whole is parsed at its end."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def reader(self) -> CallReader:
        return WholeReader(self.parse)


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in `text` (separated by whitespace, ';' or ','); [] if any
    part is not JSON or they nest deeper than MAX_JSON_DEPTH."""
    if json_depth(text) > MAX_JSON_DEPTH:
        return []
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
    """Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number;
    streamed as they are written (`HermesReader`)."""

    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.reader().read(text)
        return (content or None) if calls else text, calls

    def reader(self) -> CallReader:
        return HermesReader()


class Llama3JsonParser(ToolParser):
    """Llama 3.x: optional <|python_tag|>, then {"name": ..., "parameters": {...}} objects
    separated by ';'."""

    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [call_of(v, "parameters") for v in _json_values(body)]
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
        calls = [call_of(v, "arguments") for v in items]
        if not calls or None in calls:
            return text, []
        return content.strip() or None, calls


class PythonicParser(ToolParser):
    """Llama 3.2 / 4 pythonic: [get_weather(city="Paris"), now()], literal arguments only."""

    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        if json_depth(body) > MAX_JSON_DEPTH:  # Python's parser recurses too
            return text, []
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except (SyntaxError, RecursionError, MemoryError):
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
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}
