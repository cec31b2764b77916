"""Structured outputs over HTTP: response_format, vLLM's structured_outputs and guided_* fields,
on chat and completions, with the official openai client."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import TINY_ARGS, Server, wait_for

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
    "required": ["color", "size"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a ball."}]


def chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                          temperature=0, extra_body=extra)


def test_vllm_fields_constrain_chat_and_completions(client):
    assert chat(client, guided_choice=["yes", "no"]).choices[0].message.content in ("yes", "no")
    text = chat(client, guided_regex=r"[a-f]{4}\d").choices[0].message.content
    assert re.fullmatch(r"[a-f]{4}\d", text), text
    reply = chat(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    # (not "<" [a-z]+ ">", which special tokens such as <filename> match, and skip_special_tokens
    # then leaves out of the text)
    text = chat(client, guided_grammar='root ::= "(" [a-z] [a-z]? [a-z]? ")"')
    assert re.fullmatch(r"\([a-z]{1,3}\)", text.choices[0].message.content), text
    completion = client.completions.create(
        model="tiny", prompt="A ball:", max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    stream = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, stream=True,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("alpha", "beta")


def test_logit_bias_allowed_token_ids_and_bad_words(client, tiny_tokenizer):
    token = tiny_tokenizer.encode(" hello", add_special_tokens=False)[0]
    reply = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100})
    assert reply.choices[0].text == " hello" * 3
    reply = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0,
                                       extra_body={"allowed_token_ids": [token]})
    assert reply.choices[0].text == " hello" * 3
    plain = client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0)
    word = plain.choices[0].text.strip()
    assert word  # the tiny model's first greedy token here is a word, not whitespace
    banned = client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0,
                                       extra_body={"bad_words": [word]})
    assert banned.choices[0].text.strip() != word


def test_a_grammar_left_no_token_ends_with_abort_and_the_reason(client, tiny_tokenizer):
    """allowed_token_ids leave nothing the regex allows: the request ends with finish_reason
    "abort" and the reason in stop_reason (no 500, no token the grammar refuses), streamed or
    not, and the next request is served."""
    letter = tiny_tokenizer.encode("a", add_special_tokens=False)[0]
    extra = {"guided_regex": "[0-9]+", "allowed_token_ids": [letter]}
    choice = chat(client, **extra).choices[0]
    assert choice.finish_reason == "abort" and choice.message.content == "", choice
    assert "structured_outputs grammar" in choice.stop_reason, choice
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=5, stream=True,
                                            extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == "abort" and "structured_outputs grammar" in last.stop_reason
    assert chat(client, guided_choice=["yes", "no"]).choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"logit_bias": {"word": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_malformed_constraints_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **extra)
    assert info.value.body["param"] == param or param in info.value.body["message"], \
        info.value.body


class Answer(pydantic.BaseModel):
    city: str
    country: str
    is_capital: bool  # (an unbounded integer field lets a 135M model write digits forever)


def test_parse_returns_the_pydantic_model(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    reply = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", response_format=Answer, max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
    answer = reply.choices[0].message.parsed
    assert isinstance(answer, Answer), reply.choices[0].message.content
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", response_format={"type": "json_object"}, max_tokens=200,
        temperature=0, messages=[{"role": "user", "content": "Paris as a JSON object with "
                                  "its name and country, nothing else."}])
    text = reply.choices[0].message.content
    assert text.startswith("{")  # a JSON object, complete unless max_tokens cut it
    assert reply.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text


def test_grammar_compiles_and_cache_hits_on_metrics(client, tiny_server):
    """Compile times are a histogram; a grammar's first request misses the cache, the next
    hits it."""
    names = ["compiles_total", "cache_hits_total", "cache_misses_total", "compile_seconds_count"]

    def counts():
        return [tiny_server.metric(f"runtime:structured_output_grammar_{n}") for n in names]
    before = counts()
    for _ in range(2):  # the second request finds the grammar compiled
        chat(client, guided_regex=r"metrics-[0-9]")
    assert wait_for(lambda: [a - b for a, b in zip(counts(), before)] == [1, 1, 1, 1], 10), \
        (before, counts())
    assert tiny_server.metric("runtime:structured_output_grammar_compile_seconds_sum") > 0
    assert tiny_server.metric("runtime:structured_output_grammar_compile_seconds_bucket",
                              le="+Inf") == counts()[3]
    assert 0 < tiny_server.metric("runtime:structured_output_grammar_cache_hit_rate") < 1


LARK = 'start: "yes" | "no"'


def test_the_configured_backend_checks_requests(client, tiny_llama, tmp_path):
    """A Lark grammar is guidance's syntax: the default (xgrammar) server refuses it with a 400
    naming the field, one started with the guidance backend runs it."""
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=4,
                                  extra_body={"structured_outputs": {"grammar": LARK}})
    assert refused.value.body["param"] == "structured_outputs"
    server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny",
                     "--structured-outputs-config", '{"backend": "guidance"}'],
                    str(tmp_path / "guidance.log"))
    try:
        guided = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for extra in ({"structured_outputs": {"grammar": LARK}}, {"guided_grammar": LARK}):
            reply = guided.completions.create(model="tiny", prompt="Yes or no?", max_tokens=4,
                                              extra_body=extra)
            assert reply.choices[0].text in ("yes", "no")
        # llguidance overflows its stack on 3,000 chained rules: one grammar check worker dies,
        # not the server
        chained = "\n".join(["start: r0", *(f'r{i}: "x" r{i + 1}' for i in range(3000)),
                             'r3000: "y"'])
        with pytest.raises(openai.BadRequestError, match="crashed on it"):
            guided.completions.create(model="tiny", prompt="x", max_tokens=4,
                                      extra_body={"guided_grammar": chained})
        reply = guided.completions.create(model="tiny", prompt="Yes or no?", max_tokens=4,
                                          extra_body={"guided_grammar": LARK})
        assert reply.choices[0].text in ("yes", "no")
    finally:
        assert server.stop() == 0, server.log()
