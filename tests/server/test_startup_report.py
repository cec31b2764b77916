"""What `runtime serve` tells a newcomer: where it listens, when it started (/v1/models), and
that a chat template which drops `tools` keeps the model from calling them."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from runtime.entrypoints.chat import load_chat_template, render_chat
from runtime.entrypoints.template_tools import (renders_tools, tool_call_parser_for,
                                                tool_call_parser_of)

from tests.server.conftest import API_KEY, REPO

TOOL_TEMPLATE = f"{REPO}/examples/chat_templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def whole_log(server) -> str:
    with open(server.log_path, encoding="utf-8") as f:
        return f.read()  # the start-up lines, wherever the session-wide server's log stands


def test_the_log_names_the_address_and_the_models_card_its_start_time(tiny_server):
    assert (f"Serving tiny on http://127.0.0.1:{tiny_server.port} (OpenAI, Anthropic, Responses; "
            "docs at /docs)") in whole_log(tiny_server)
    reply = httpx.get(tiny_server.url + "/v1/models", timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    created = reply.json()["data"][0]["created"]
    assert time.time() - 3600 < created <= time.time()


def test_a_template_without_tools_is_reported_at_start_up(tiny_server):
    # The tiny model carries SmolLM2's tokenizer, whose template never reads `tools`.
    log = whole_log(tiny_server)
    assert "does not render `tools`" in log
    assert "examples/chat_templates/chatml_tools.jinja" in log


def test_the_shipped_tool_template_shows_the_tools_and_picks_its_parser(tiny_tokenizer, caplog):
    template = load_chat_template(TOOL_TEMPLATE)
    assert renders_tools(template) and tool_call_parser_for(template) == "hermes"
    assert not renders_tools(tiny_tokenizer.chat_template)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tiny_tokenizer.decode(render_chat(tiny_tokenizer, messages, template,
                                                   tools=[WEATHER]))
    assert json.dumps(WEATHER["function"]) in with_tools and "<tool_call>" in with_tools
    without = tiny_tokenizer.decode(render_chat(tiny_tokenizer, messages, template))
    default = tiny_tokenizer.decode(render_chat(tiny_tokenizer, messages, None))
    assert without == default  # no tools: the same prompt as SmolLM2's own template
    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    history = tiny_tokenizer.decode(render_chat(tiny_tokenizer, [*messages, call, result],
                                                template, tools=[WEATHER]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in history
    assert "<tool_response>\nsunny\n</tool_response>" in history


def test_auto_tool_choice_takes_the_parser_of_the_template(tiny_tokenizer):
    template = load_chat_template(TOOL_TEMPLATE)
    assert tool_call_parser_of(template, "m", None, True) == "hermes"
    assert tool_call_parser_of(template, "m", "pythonic", True) == "pythonic"
    assert tool_call_parser_of(tiny_tokenizer.chat_template, "m", None, False) is None
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        tool_call_parser_of(tiny_tokenizer.chat_template, "m", None, True)
