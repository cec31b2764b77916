"""/v1/responses (the OpenAI Responses API) with the official openai client: text, streaming
events, text.format (json_schema, `responses.parse`) and refused fields on the tiny random model,
where only the grammar can make the output valid; json_object (a random model writes its free
strings without end) and function tools on the default model (SmolLM2-135M-Instruct), as the chat
route's tool tests do."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}, "strict": True}
TOOLS = [WEATHER, TIME]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def smol(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def tiny(client, **kwargs):
    return client.responses.create(**{"model": "tiny", "temperature": 0, **kwargs})


def smol_create(smol, **kwargs):
    return smol.responses.create(**{"model": MODEL, "temperature": 0, **kwargs})


def test_text_is_the_chat_routes_greedy_text(client):
    reply = tiny(client, input="Hello there", instructions="Be brief.", max_output_tokens=8)
    chat = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello there"}])
    assert reply.object == "response" and reply.model == "tiny"
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    items = tiny(client, max_output_tokens=8, input=[
        {"role": "developer", "content": "Be brief."},  # a developer message is a system one
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "Hello there"}]}])
    assert items.output_text == reply.output_text


def test_streaming_events_reassemble_to_the_same_text(client):
    kwargs = dict(input="Tell me a story", max_output_tokens=24)
    whole = tiny(client, **kwargs)
    events = list(tiny(client, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[a-f]{4}[0-9]$"},
    {"enum": ["red", "green", 3]},
])
def test_text_format_json_schema_holds(client, schema):
    kwargs = dict(input="Describe a ball.", max_output_tokens=30, text={"format": {
        "type": "json_schema", "name": "ball", "schema": schema, "strict": True}})
    reply = tiny(client, **kwargs)
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert reply.text.format.type == "json_schema" and reply.status == "completed"
    # the SDK's stream helper rebuilds the same response from the events
    with client.responses.stream(model="tiny", temperature=0, **kwargs) as stream:
        assert stream.get_final_response().output_text == reply.output_text


class Ball(pydantic.BaseModel):
    color: Literal["red", "green"]
    bounces: bool


def test_parse_gives_the_pydantic_model(client):
    reply = client.responses.parse(model="tiny", input="Describe a ball as JSON.", temperature=0,
                                   max_output_tokens=60, text_format=Ball)
    assert isinstance(reply.output_parsed, Ball), reply.output_text


def test_json_object(smol):
    reply = smol_create(smol, input="Paris as a JSON object with its name and country.",
                        max_output_tokens=100, text={"format": {"type": "json_object"}})
    assert reply.output_text.startswith("{")
    assert reply.status == "incomplete" or isinstance(json.loads(reply.output_text), dict)


def check_call(item) -> dict:
    assert item.type == "function_call" and item.call_id.startswith("call_")
    tool = next(t for t in TOOLS if t["name"] == item.name)
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


def test_function_tools_required_and_named(smol):
    reply = smol_create(smol, input=ASK, tools=TOOLS, tool_choice="required",
                        max_output_tokens=100)
    assert reply.output and all(item.type == "function_call" for item in reply.output)
    for item in reply.output:
        check_call(item)
    (item,) = smol_create(smol, input=ASK, tools=TOOLS, max_output_tokens=60,
                          tool_choice={"type": "function", "name": "get_time"}).output
    assert item.name == "get_time" and check_call(item)["zone"] in ("UTC", "CET")


def test_streamed_call_comes_in_pieces_and_reassembles(smol):
    kwargs = dict(input=ASK, tools=TOOLS, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    (whole,) = smol_create(smol, **kwargs).output
    events = list(smol_create(smol, stream=True, **kwargs))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(a.type, a.name, a.arguments) for a in added] == [("function_call", whole.name, "")]
    assert len(deltas) > 3 and "".join(deltas) == done.arguments == whole.arguments
    assert events[-1].type == "response.completed"
    (final,) = events[-1].response.output
    assert (final.name, final.arguments, final.status) == (whole.name, whole.arguments,
                                                           "completed")


def test_function_call_output_goes_back_in(smol):
    (call,) = smol_create(smol, input=ASK, tools=TOOLS, max_output_tokens=60,
                          tool_choice={"type": "function", "name": "get_weather"}).output
    back = [{"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": "18 degrees, sunny"}]
    reply = smol_create(smol, input=back, tools=TOOLS, tool_choice="none",
                        max_output_tokens=12)
    assert reply.output[0].type == "message"
    # the same conversation on the chat route renders the same prompt, gives the same text
    chat = smol.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, tool_choice="none",
        tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                    "parameters")}}
               for t in TOOLS],
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": "", "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id,
                   "content": "18 degrees, sunny"}])
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"store": True}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # no --tool-call-parser
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_what_is_not_honoured_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", **{"input": "hi", "max_output_tokens": 4, **extra})
    assert info.value.body["param"] == param, info.value.body


def test_an_output_the_engine_ended_fails_with_the_reason():
    """finish_reason "abort" (a grammar left no token, a request at two core deaths) is a
    failed response with the reason, never "completed"."""
    from runtime.entrypoints.responses_api import finished_status
    from runtime.outputs import CompletionOutput
    ended = CompletionOutput(0, "", [], finish_reason="abort",
                             stop_reason="the structured_outputs grammar allows no token")
    assert finished_status(ended) == ("failed", "incomplete", {
        "code": "server_error", "message": "the structured_outputs grammar allows no token"})
    assert finished_status(CompletionOutput(0, "x", [1], finish_reason="length"))[:2] == \
        ("incomplete", "incomplete")
    assert finished_status(CompletionOutput(0, "x", [1], finish_reason="stop")) == \
        ("completed", "completed", None)
