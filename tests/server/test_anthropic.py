"""The Anthropic Messages API, driven by the official `anthropic` client."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "Write a haiku about rivers."}]
GREEDY = {"temperature": 0}  # recent clients dropped the sampling arguments; the API keeps them


@pytest.fixture
def claude(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key=API_KEY, max_retries=0,
                               timeout=120)


def test_message(claude, tiny_server):
    reply = claude.messages.create(model="tiny", max_tokens=8, messages=MESSAGES,
                                   system="You are a poet.", extra_body=GREEDY)
    assert reply.role == "assistant" and reply.type == "message"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("max_tokens", "end_turn")
    counted = httpx.post(tiny_server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": "You are a poet."}, *MESSAGES]}).json()
    assert reply.usage.input_tokens == counted["count"]
    assert 0 < reply.usage.output_tokens <= 8


def test_streaming_events_equal_the_message(claude):
    whole = claude.messages.create(model="tiny", max_tokens=12, messages=MESSAGES,
                                   extra_body=GREEDY)
    with claude.messages.stream(model="tiny", max_tokens=12, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stop_sequence(claude):
    text = claude.messages.create(model="tiny", max_tokens=24, messages=MESSAGES,
                                  extra_body=GREEDY).content[0].text
    if len(text) < 11:
        pytest.skip("the random model ended too early")
    stop = text[8:11]
    reply = claude.messages.create(model="tiny", max_tokens=24, messages=MESSAGES,
                                   extra_body=GREEDY, stop_sequences=[stop])
    assert reply.content[0].text == text[:text.index(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


def test_bad_request_has_the_anthropic_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=4, messages=MESSAGES,
                               extra_body={"temperature": -1})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"


WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


def test_a_streamed_tool_use_comes_in_pieces_and_reassembles(claude):
    kwargs = dict(model="tiny", max_tokens=60, messages=MESSAGES, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    (use,) = whole.content
    assert use.type == "tool_use" and whole.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "get_weather", {})]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == use.input
    (streamed,) = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", use.name, use.input)
    assert streamed.id.startswith("toolu_") and final.stop_reason == "tool_use"
