"""What a chat request's `tools` and `tool_choice` mean for the engine and the reply."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.errors import bad_request
from runtime.entrypoints.structured import checked
from runtime.entrypoints.tool_parsers.parsers import TOOL_PARSERS, ToolParser
from runtime.entrypoints.tool_parsers.streaming import (CallReader, Delta, NamedCallReader,
                                                        RequiredCallsReader, TextReader)
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutputsParams
from runtime.structured_output.params import loads_json_text


class ToolChoice:
    """`tools` go to the chat template. "required" or a named function force a call with a
    grammar built from the parameter schemas; "auto" finds the calls the model chose to write
    with the server's `--tool-call-parser`; "none" (the default without tools) reads no calls.
    Without `parallel`, at most one call is made (forced) or read (auto).
    """

    def __init__(self, tools: list[dict] | None, choice: str | None, parser: str | None,
                 auto_enabled: bool, parallel: bool = True, named: str | None = None) -> None:
        self.tools = tools or None
        self.parallel = parallel
        self.forced: str | None = None  # the named function
        self.required = False
        self.parser: ToolParser | None = None
        if choice is None and named is None:
            choice = "auto" if self.tools else "none"
        if self.tools is None and choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        self.required = choice == "required"
        if named is not None:
            if named not in {t["function"]["name"] for t in self.tools}:
                raise bad_request(f"tool_choice names the function {named!r}, which is not "
                                  "among the tools", param="tool_choice")
            self.forced = named
        if choice == "auto":
            if not auto_enabled or parser is None:
                raise bad_request('tool_choice "auto" needs the server started with '
                                  "--enable-auto-tool-choice and --tool-call-parser "
                                  f"({', '.join(TOOL_PARSERS)}); \"required\" or a named "
                                  "function work without them", param="tool_choice")
            self.parser = TOOL_PARSERS[parser]()

    @classmethod
    def of(cls, body: Any, parser: str | None, auto_enabled: bool) -> "ToolChoice":
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        if isinstance(choice, str) or choice is None:
            return cls(tools, choice, parser, auto_enabled, body.parallel_tool_calls)
        return cls(tools, None, parser, auto_enabled, body.parallel_tool_calls,
                   named=choice.function.get("name"))

    @property
    def reads_calls(self) -> bool:
        return self.parser is not None or self.required or self.forced is not None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that forces the call, for "required" and a named function."""
        if not self.forces_call:
            return None
        schema = forced_call_schema(self.tools, self.forced)
        if self.required and not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    @property
    def forces_call(self) -> bool:
        return self.required or self.forced is not None

    def constrain(self, params: SamplingParams, format_param: str) -> SamplingParams:
        """`params` with the grammar that forces the call, if there is one; a 400 when the
        request constrains the output otherwise too (`format_param` names how)."""
        forced = self.structured_outputs()
        if forced is None:
            return params
        if params.structured_outputs is not None:
            raise bad_request(f"a forced tool_choice and {format_param} both constrain the "
                              "output: give only one", param="tool_choice")
        return params.clone(structured_outputs=checked("tools", {"json": forced.json}))

    def reader(self) -> CallReader:
        """A reader for one output (one per sample): its content and call deltas."""
        if self.forced is not None:
            return NamedCallReader(self.forced)
        if self.required:
            return RequiredCallsReader()
        return self.parser.reader() if self.parser is not None else TextReader()

    def limit(self, delta: Delta) -> Delta:
        """Without `parallel`, only the first call."""
        if not self.parallel:
            delta.calls = [c for c in delta.calls if c["index"] == 0]
        return delta

    def message(self, text: str) -> tuple[dict, bool]:
        """The assistant message for a finished output, and whether it holds calls."""
        content, calls = self.reader().read(text)
        calls = calls if self.parallel else calls[:1]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": (content or None) if calls else content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, bool(calls)


def forced_call_schema(tools: list[dict], choice: str | None) -> dict:
    """The JSON schema a forced output follows: the named function's parameters, or (choice
    None: "required") a non-empty list of {"name", "parameters"} calls of any tool, each tool's
    `$defs` (pydantic's `#/$defs/...` refs) moved to the root under its name."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice is not None:
        return functions[choice].get("parameters") or {"type": "object"}
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {
        "name": {"const": name},
        "parameters": _hoist_defs(name, f.get("parameters") or {"type": "object"}, defs)},
        "required": ["name", "parameters"], "additionalProperties": False}
        for name, f in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def _hoist_defs(name: str, parameters: dict, defs: dict[str, Any]) -> dict:
    """`parameters` without its `$defs` / `definitions`, which go into `defs` as "name.key",
    its local refs to them rewritten to match."""
    own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not own:
        return parameters

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{name}.{ref[len(prefix):]}"
        return out

    defs.update({f"{name}.{key}": rewrite(value) for key, value in own.items()})
    return {k: v for k, v in rewrite(parameters).items() if k not in ("$defs", "definitions")}


def template_messages(messages: list[Any], text_of, param: str = "messages") -> list[dict]:
    """Chat messages as chat templates read them: text content, and earlier calls with their
    arguments as objects (what Hugging Face templates iterate over). `param` names the request
    field they came from, for errors."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": text_of(m.content)}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c, param) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        if m.reasoning is not None:  # templates read reasoning_content
            message["reasoning_content"] = message["reasoning"] = m.reasoning
        out.append(message)
    return out


def _template_call(call: dict, param: str) -> dict:
    function = call.get("function") or {}
    if not isinstance(function, dict):
        raise bad_request("a tool call's function must be an object with a name and "
                          "arguments", param=param)
    function = dict(function)
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = loads_json_text(function["arguments"],
                                                    "a tool call's arguments")
        except ValueError as e:
            raise bad_request(f"{e} (they must be JSON text)", param=param) from None
    return {**call, "function": function}

