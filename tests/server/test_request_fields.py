"""No request field is silently dropped: every field of the official OpenAI and Anthropic
request types (from their own SDKs) is a field of our request bodies, and each one this server
does not honour is refused with a 400 naming it."""
from __future__ import annotations

import httpx
import openai
import pydantic
import pytest
import anthropic.types as anthropic_types
import openai.types.chat as chat_params
import openai.types.responses as responses_params
from anthropic.types import message_count_tokens_params, message_create_params
from openai.types import completion_create_params, shared_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from openai.types.shared_params.response_format_json_schema import JSONSchema
from pydantic import BeforeValidator

from runtime.entrypoints.protocol import (AnthropicTool, AnthropicToolChoice,
                                          ChatCompletionRequest, CompletionRequest,
                                          CountTokensRequest, FunctionDefinition,
                                          JsonSchemaFormat, MessagesRequest, NamedToolChoice,
                                          StreamOptions, Tool)
from runtime.entrypoints.responses_protocol import (FunctionChoice, FunctionTool,
                                                    ReasoningConfig, ResponsesRequest,
                                                    TextConfig, TextJsonSchema)
from tests.server.conftest import API_KEY

APIS = {
    "chat": (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest,
             {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": (completion_create_params.CompletionCreateParamsBase, CompletionRequest,
                    {"prompt": "hi"}),
    "messages": (message_create_params.MessageCreateParamsBase, MessagesRequest,
                 {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    "count_tokens": (message_count_tokens_params.MessageCountTokensParams, CountTokensRequest,
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "responses": (response_create_params.ResponseCreateParamsBase, ResponsesRequest,
                  {"input": "hi"}),
}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "messages": "/v1/messages", "responses": "/v1/responses",
          "count_tokens": "/v1/messages/count_tokens"}


def refused(model: type[pydantic.BaseModel], name: str) -> bool:
    """Whether the field is one the server refuses (declared with `protocol.only`)."""
    return any(isinstance(m, BeforeValidator) and m.func.__qualname__.startswith("only.")
               for m in model.model_fields[name].metadata)


@pytest.mark.parametrize("api", sorted(APIS))
def test_every_official_field_is_declared(api):
    sdk, model, _ = APIS[api]
    missing = sorted(set(sdk.__annotations__) - set(model.model_fields))
    assert not missing, f"{api}: fields the SDK sends that we would drop unseen: {missing}"


def declared(model: type[pydantic.BaseModel]) -> set[str]:
    """The field names a body takes, as the wire spells them (aliases: `schema`, `async`)."""
    return {f.alias or name for name, f in model.model_fields.items()}


# The objects inside a request that carry options (not the messages and items that clients send
# back from a response): the SDK's type of each, and ours.
NESTED = {
    "chat stream_options": (chat_params.ChatCompletionStreamOptionsParam, StreamOptions),
    "chat response_format.json_schema": (JSONSchema, JsonSchemaFormat),
    "chat tools[].function": (shared_params.FunctionDefinition, FunctionDefinition),
    "chat tools[]": (chat_params.ChatCompletionFunctionToolParam, Tool),
    "chat tool_choice": (chat_params.ChatCompletionNamedToolChoiceParam, NamedToolChoice),
    "messages tools[]": (anthropic_types.ToolParam, AnthropicTool),
    "messages tool_choice": (anthropic_types.ToolChoiceToolParam, AnthropicToolChoice),
    "responses tools[]": (responses_params.FunctionToolParam, FunctionTool),
    "responses text": (responses_params.ResponseTextConfigParam, TextConfig),
    "responses text.format": (responses_params.ResponseFormatTextJSONSchemaConfigParam,
                              TextJsonSchema),
    "responses tool_choice": (responses_params.ToolChoiceFunctionParam, FunctionChoice),
    "responses reasoning": (shared_params.Reasoning, ReasoningConfig),
}


@pytest.mark.parametrize("where", sorted(NESTED))
def test_every_official_nested_field_is_declared(where):
    """Objects inside a body ignore unknown keys (clients send back what responses held), so
    a field the SDK gains there would be dropped unseen: each must be declared, and refused
    with `only` when it is not honoured."""
    sdk, model = NESTED[where]
    missing = sorted(set(sdk.__annotations__) - declared(model))
    assert not missing, f"{where}: fields the SDK sends that we would drop unseen: {missing}"


@pytest.mark.parametrize("api", sorted(APIS))
def test_refused_fields_name_themselves(api):
    sdk, model, minimal = APIS[api]
    names = [n for n in sdk.__annotations__ if refused(model, n)]
    assert names or api == "completions"
    for name in names:
        model.model_validate({**minimal, name: None})  # absent or null asks for nothing
        with pytest.raises(pydantic.ValidationError) as info:
            model.model_validate({**minimal, name: "unsupported-value"})
        assert info.value.errors()[0]["loc"][0] == name


def test_the_server_answers_400_with_the_field(client):
    for name, value in (("audio", {"voice": "alloy", "format": "wav"}),
                        ("reasoning_effort", "high"), ("store", True)):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body={name: value})
        assert info.value.body["param"] == name and "not supported" in info.value.body["message"]


@pytest.mark.parametrize("api", sorted(APIS))
def test_the_server_refuses_each_field_it_does_not_honour(api, tiny_server):
    """Every refused field of every API, sent with a value that asks for something: a 400 that
    names it (OpenAI's `param`; Anthropic's error body has none, its message names it)."""
    sdk, model, minimal = APIS[api]
    names = [n for n in sdk.__annotations__ if refused(model, n)]
    with httpx.Client(base_url=tiny_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        limit = {"max_tokens": 2} if "max_tokens" in model.model_fields else {}
        for name in names:
            reply = http.post(ROUTES[api], json={**minimal, **limit, name: "unsupported-value"})
            assert reply.status_code == 400, (name, reply.text)
            error = reply.json()["error"]
            assert error.get("param", name) == name and name in error["message"], error


VLLM_REFUSED = ["guided_decoding_backend", "guided_whitespace_pattern", "logits_processors",
                "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
                "spaces_between_special_tokens", "truncate_prompt_tokens", "add_special_tokens"]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_vllms_extras_this_server_does_not_honour_are_refused(api):
    _, model, minimal = APIS[api]
    names = VLLM_REFUSED + (["chat_template", "documents", "echo"] if api == "chat" else [])
    for name in names:
        assert refused(model, name), name
        with pytest.raises(pydantic.ValidationError) as info:
            model.model_validate({**minimal, name: "unsupported-value"})
        assert info.value.errors()[0]["loc"][0] == name


BODIES = {"/v1/chat/completions": APIS["chat"][2], "/v1/completions": APIS["completions"][2],
          "/v1/messages": APIS["messages"][2], "/v1/responses": APIS["responses"][2],
          "/v1/messages/count_tokens": APIS["count_tokens"][2],
          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_unknown_fields_are_a_400_naming_them(path, tiny_server):
    reply = httpx.post(tiny_server.url + path, json={**BODIES[path], "no_such_field": 1},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "no_such_field" in error["message"] and error.get("param", "no_such_field") == \
        "no_such_field", error


def test_honoured_vllm_chat_extras(client, tiny_tokenizer):
    """continue_final_message leaves the assistant's message open, as transformers renders it;
    chat_template_kwargs may not override the rendering's own arguments."""
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi t"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = tiny_tokenizer.apply_chat_template(messages, continue_final_message=True,
                                              tokenize=False)
    assert text.endswith("Hi t")  # the message is left open
    assert reply.usage.prompt_tokens == len(tiny_tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.body["param"] == "chat_template_kwargs"
