"""Reading tool calls as the output comes: each reader takes the text piece by piece and answers
content and OpenAI `tool_calls` deltas (the first of a call with its index, id, type and name,
then fragments of its arguments). A finished output read whole gives the same calls as read in
pieces, so a streamed call reassembles to exactly the non-streamed one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from runtime.entrypoints.tool_parsers.calls import ToolCall, call_of
from runtime.structured_output.params import loads_json_text


@dataclass
class Delta:
    """What a piece of output adds to the assistant message."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls deltas

    def add(self, other: "Delta") -> "Delta":
        self.content += other.content
        for call in other.calls:
            self.add_call(call)
        return self

    def add_call(self, call: dict | None) -> None:
        """Appends a call delta; an arguments fragment joins the one before it for that call."""
        if call is None:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last["index"] == call["index"] and "id" not in call:
            last["function"]["arguments"] += call["function"]["arguments"]
        else:
            self.calls.append(call)


class CallReader:
    """One output's calls, read piece by piece. `failed` turns true when the output is not the
    format after all (a call cut short, malformed JSON); the rest then comes as content."""

    def __init__(self) -> None:
        self.failed = False

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        """What the end of the output settles (text held back in case a call began)."""
        return Delta()

    def read(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: its content and calls (no calls, all content, when `failed`)."""
        delta = self.feed(text).add(self.finish())
        return (text, []) if self.failed else (delta.content, assemble(delta.calls))


def assemble(deltas: list[dict]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = ToolCall(d["function"]["name"], "", d["id"])
        calls[d["index"]].arguments += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def first_delta(index: int, call: ToolCall) -> dict:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class TextReader(CallReader):
    """No calls to read: everything is content."""

    def feed(self, text: str) -> Delta:
        return Delta(text)


class WholeReader(CallReader):
    """A format read only once the output is complete (`parse` on the whole text)."""

    def __init__(self, parse: Callable[[str], tuple[str | None, list[ToolCall]]]) -> None:
        super().__init__()
        self.parse = parse
        self.text = ""

    def feed(self, text: str) -> Delta:
        self.text += text
        return Delta()

    def finish(self) -> Delta:
        content, calls = self.parse(self.text)
        return Delta(content or "", [first_delta(i, c) for i, c in enumerate(calls)])


class _Nesting:
    """Where a JSON object or array, fed character by character, ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def push(self, c: str) -> bool:
        """Whether `c` closes the outermost value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class _Arguments:
    """A call's arguments object, streamed as it is written; `push` answers the delta."""

    def __init__(self, index: int, name: str) -> None:
        self.call = ToolCall(name, "")
        self.index = index
        self.nesting = _Nesting()
        self.done = False

    def push(self, c: str) -> dict:
        self.done = self.nesting.push(c)
        self.call.arguments += c
        if len(self.call.arguments) == 1:
            return first_delta(self.index, self.call)
        return {"index": self.index, "function": {"arguments": c}}

    def valid(self) -> bool:
        try:
            return isinstance(loads_json_text(self.call.arguments, "a tool call"), dict)
        except ValueError:
            return False


class _CallObject:
    """One call written as {"name": ..., "<key>": {...}}: its first delta as soon as the name
    and the opening of the arguments are written, then the arguments as they come. An object
    with its keys in another order or arguments as a JSON string comes whole when complete."""

    def __init__(self, index: int, key: str) -> None:
        self.index = index
        self.key = key
        self.header = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"'
                                 + re.escape(key) + r'"\s*:\s*')
        self.text = ""
        self.nesting = _Nesting()
        self.arguments: _Arguments | None = None
        self.done = False
        self.failed = False

    def push(self, c: str) -> dict | None:
        self.text += c
        closed = self.nesting.push(c)
        if self.arguments is None:
            if c == "{" and (m := self.header.fullmatch(self.text[:-1])):
                self.arguments = _Arguments(self.index, json.loads(m.group(1)))
                return self.arguments.push(c)
            if closed:
                return self._whole()
            return None
        if not self.arguments.done:
            return self.arguments.push(c)
        if closed:  # the object's own "}" after the arguments
            self.done = True
            self.failed = not self.arguments.valid() or self._parsed() is None
        elif not c.isspace():  # another key after the arguments
            self.failed = True
        return None

    def _parsed(self) -> ToolCall | None:
        try:
            return call_of(loads_json_text(self.text, "a tool call"), self.key)
        except ValueError:
            return None

    def _whole(self) -> dict | None:
        self.done = True
        call = self._parsed()
        self.failed = call is None
        return None if call is None else first_delta(self.index, call)


class _Machine(CallReader):
    """A reader driven character by character through states; `step(c)` handles one."""

    def __init__(self) -> None:
        super().__init__()
        self.out = Delta()

    def feed(self, text: str) -> Delta:
        self.out = Delta()
        for i, c in enumerate(text):
            if self.failed:  # not the format after all: the rest is content
                self.out.content += text[i:]
                return self.out
            self.step(c)
        return self.flush()

    def flush(self) -> Delta:
        return self.out

    def step(self, c: str) -> None:
        raise NotImplementedError


class HermesReader(_Machine):
    """Hermes / Qwen: content, then <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    blocks. Content is held back while it may be the start of a block; whitespace right before
    the first block is not content, nor is any text after it outside the blocks."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content | open | call | close | between
        self.held = ""  # content or markers not yet known to be either
        self.call: _CallObject | None = None
        self.count = 0

    def step(self, c: str) -> None:
        if self.state in ("content", "between"):
            self.held += c
            if self.held.endswith(self.START):
                if self.state == "content":
                    self.out.content += self.held[:-len(self.START)].rstrip()
                self.held, self.state = "", "open"
        elif self.state == "open":
            if c == "{":
                self.call, self.state = _CallObject(self.count, "arguments"), "call"
                self.count += 1
                self.out.add_call(self.call.push(c))
            elif not c.isspace():
                self.failed = True
        elif self.state == "call":
            self.out.add_call(self.call.push(c))
            self.failed = self.call.failed
            if self.call.done:
                self.state = "close"
        elif self.state == "close":
            self.held += c
            if self.held.lstrip() == self.END:
                self.held, self.state = "", "between"
            elif not self.END.startswith(self.held.lstrip()):
                self.failed = True

    def flush(self) -> Delta:
        """Content sent as far as it cannot be the start of a block."""
        if self.state == "content":
            keep = _marker_tail(self.held, self.START)
            self.out.content += self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
        elif self.state == "between":
            self.held = self.held[len(self.held) - _marker_tail(self.held, self.START):]
        return self.out

    def finish(self) -> Delta:
        if self.state == "content":
            return Delta(self.held)
        if self.state in ("open", "call"):  # a block cut short
            self.failed = True
        return Delta()


def _marker_tail(text: str, marker: str) -> int:
    """The length of the end of `text` that may still become (whitespace and) `marker`."""
    for start in range(len(text)):
        tail = text[start:]
        if marker.startswith(tail.lstrip()):
            return len(tail)
    return 0


class NamedCallReader(_Machine):
    """tool_choice naming a function: the output is its arguments object (grammar-enforced)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.arguments = _Arguments(0, name)

    def step(self, c: str) -> None:
        if self.arguments.done or (not self.arguments.call.arguments and c != "{"):
            self.failed = not c.isspace()
        else:
            self.out.add_call(self.arguments.push(c))

    def finish(self) -> Delta:
        self.failed = self.failed or not self.arguments.done or not self.arguments.valid()
        return Delta()


class RequiredCallsReader(_Machine):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"} objects
    (grammar-enforced, `forced_call_schema`)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | item | call | after | end
        self.call: _CallObject | None = None
        self.count = 0

    def step(self, c: str) -> None:
        if self.state == "call":
            self.out.add_call(self.call.push(c))
            self.failed = self.call.failed
            if self.call.done:
                self.state = "after"
        elif c.isspace():
            return
        elif self.state == "start" and c == "[":
            self.state = "item"
        elif self.state == "item" and c == "{":
            self.call, self.state = _CallObject(self.count, "parameters"), "call"
            self.count += 1
            self.out.add_call(self.call.push(c))
        elif self.state == "after" and c in ",]":
            self.state = "item" if c == "," else "end"
        else:
            self.failed = True

    def finish(self) -> Delta:
        self.failed = self.failed or self.state != "end"
        return Delta()

