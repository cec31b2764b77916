"""Tool calling on /v1/chat/completions with the default model (SmolLM2-135M-Instruct) and the
official openai client: forced calls always parse and validate; streamed calls reassemble."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from runtime.entrypoints.tool_parsers import TOOL_PARSERS, Delta
from runtime.entrypoints.tool_parsers.streaming import assemble

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def check_call(call, tools=TOOLS) -> dict:
    schema = next(t["function"]["parameters"] for t in tools
                  if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def test_required_and_named_calls_parse_and_validate(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=100,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=100, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    check_call(call)


def streamed_calls(stream) -> tuple[list[dict], int, str | None]:
    """The calls reassembled from a chat stream's tool_calls deltas, the number of chunks that
    carried them, and the finish reason."""
    calls: dict[int, dict] = {}
    chunks, finish = 0, None
    for chunk in stream:
        deltas = chunk.choices[0].delta.tool_calls or []
        chunks += bool(deltas)
        for d in deltas:
            if d.id is not None:  # the first delta of a call: its id, type and name
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], chunks, finish


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_come_token_by_token_and_reassemble_exactly(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
                  tool_choice=tool_choice)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, chunks, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                          **kwargs))
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(w.function.name, w.function.arguments) for w in whole]
    assert chunks > len(calls) + 3  # the arguments came in pieces, as the tokens did
    assert finish == "tool_calls"


def test_tool_results_go_back_in(client):
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_auto_reads_the_models_own_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="auto", max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")


def test_bad_tool_choices_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required",
                                       max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="give only one"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=5,
                                       response_format={"type": "json_object"})


@pytest.mark.parametrize("parser, text, calls", [
    ("hermes", 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
     [("f", {"a": 1})]),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call><tool_call>'
               '{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>', [("f", {"a": 1}), ("g", {"b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                    '{"name": "g", "parameters": {}}', [("f", {"a": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}]', [("f", {"a": [1, 2]})]),
    ("pythonic", '[f(a=1, b="x"), g()]', [("f", {"a": 1, "b": "x"}), ("g", {})]),
    ("hermes", "No call here.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', []),  # cut short
    ("pythonic", "[f(x)]", []),  # positional arguments: not a call this format writes
])
def test_parsers_read_their_formats(parser, text, calls):
    content, found = TOOL_PARSERS[parser]().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert (content == text) == (not calls)


HERMES_OUTPUT = ('Let me look.  <tool_call>\n{"name": "get_weather", "arguments": {"city": '
                 '"Paris \\"}{\\" Nord", "days": [1, {"x": null}]}}\n</tool_call>\n'
                 '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>')


@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_hermes_reader_streams_what_parse_reads(piece):
    """In pieces of any size, the calls' deltas come as they are written (the first with id,
    type and name) and join to exactly what the whole text parses to."""
    parser = TOOL_PARSERS["hermes"]()
    content, whole = parser.parse(HERMES_OUTPUT)
    reader, read, first_call_pieces = parser.reader(), Delta(), 0
    for i in range(0, len(HERMES_OUTPUT), piece):
        delta = reader.feed(HERMES_OUTPUT[i:i + piece])
        first_call_pieces += any(c["index"] == 0 for c in delta.calls)
        read.add(delta)
    read.add(reader.finish())
    assert not reader.failed and read.content == content == "Let me look."
    streamed = [(c.name, c.arguments) for c in assemble(read.calls)]
    assert streamed == [(c.name, c.arguments) for c in whole]
    assert whole[0].arguments == '{"city": "Paris \\"}{\\" Nord", "days": [1, {"x": null}]}'
    # the first call streamed as it was written; the second (keys reordered) came whole
    assert first_call_pieces >= len(whole[0].arguments) // piece
    assert [c["function"]["arguments"] for c in read.calls if c["index"] == 1] == \
        [whole[1].arguments]


def test_anthropic_tools(smollm2_server):
    import anthropic
    claude = anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0,
                                 timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    reply = claude.messages.create(model=MODEL, max_tokens=100, messages=ASK, tools=tools,
                                   tool_choice={"type": "any"},
                                   extra_body={"temperature": 0})  # (not in the SDK's types)
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses
    for use in uses:
        schema = next(t["input_schema"] for t in tools if t["name"] == use.name)
        jsonschema.validate(use.input, schema)
    kwargs = dict(model=MODEL, max_tokens=100, messages=ASK, tools=tools,
                  extra_body={"temperature": 0},
                  tool_choice={"type": "tool", "name": "get_time"})
    (use,) = [b for b in claude.messages.create(**kwargs).content if b.type == "tool_use"]
    assert use.name == "get_time" and use.id.startswith("toolu_")
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"
    back = ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "12:00"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=20, messages=back, tools=tools,
                                    tool_choice={"type": "none"},
                                    extra_body={"temperature": 0})
    assert answer.content[0].type == "text" and answer.stop_reason != "tool_use"


def test_pydantic_tool_schemas_keep_their_defs_under_forced_calls(client):
    """A pydantic model's schema refers to its `$defs` (`#/$defs/Unit`): forced calls of such
    tools ("required" puts every tool's parameters inside one schema) follow it."""
    import enum

    import pydantic

    class Unit(enum.Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=30)
        unit: Unit

    parameters = Weather.model_json_schema()
    assert "$defs" in parameters
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             TIME]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                               tool_choice=tool_choice, max_tokens=100,
                                               temperature=0)
        for call in reply.choices[0].message.tool_calls:
            schema = parameters if call.function.name == "get_weather" else \
                TIME["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
