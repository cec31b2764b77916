"""Where the server answers as OpenAI and vLLM do, found side by side with vLLM (issue 33): an
unknown model is a 404, the developer role, stop_reason on EOS, /version, non-JSON bodies,
stream_options without stream, grammar errors without xgrammar's source paths, Responses'
top_p."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]


def test_an_unknown_model_is_a_404(client, tiny_server):
    for create in (lambda: client.chat.completions.create(model="gpt-4", messages=HI),
                   lambda: client.completions.create(model="gpt-4", prompt="hi"),
                   lambda: client.responses.create(model="gpt-4", input="hi")):
        with pytest.raises(openai.NotFoundError) as info:
            create()
        error = info.value.body
        assert (error["type"], error["param"], error["code"]) == \
            ("invalid_request_error", "model", "model_not_found"), error
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude", max_tokens=2, messages=HI)
    assert info.value.body["error"]["type"] == "not_found_error"


def test_developer_is_system_when_the_template_has_no_developer_role(client):
    def prompt_tokens(role: str) -> int:
        return client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": role, "content": "Be brief."}, *HI]).usage.prompt_tokens
    assert prompt_tokens("developer") == prompt_tokens("system")


def test_eos_has_no_stop_reason_a_stop_token_has_its_id(client, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    forced = {"logit_bias": {str(eos): 100}}
    choice = client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                       extra_body=forced).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", None)
    choice = client.completions.create(
        model="tiny", prompt="hi", max_tokens=4,
        extra_body={**forced, "ignore_eos": True, "stop_token_ids": [eos]}).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", eos)


def test_version(tiny_server):
    import runtime
    assert httpx.get(tiny_server.url + "/version").json() == {"version": runtime.__version__}


def test_a_body_that_is_not_json_is_a_415(tiny_server):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        reply = httpx.post(tiny_server.url + path, content=b"hi", headers={
            **AUTH, "x-api-key": API_KEY, "Content-Type": "text/plain"})
        assert reply.status_code == 415, reply.text
        body = reply.json()
        error = body["error"]
        assert "application/json" in error["message"] and "text/plain" in error["message"]
        assert body.get("type") == ("error" if path == "/v1/messages" else None)


def test_stream_options_need_stream(client):
    for create in (lambda: client.chat.completions.create(
                       model="tiny", messages=HI, max_tokens=2,
                       stream_options={"include_usage": True}),
                   lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                     stream_options={"include_usage": True})):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        assert info.value.body["param"] == "stream_options"


def test_grammar_errors_do_not_show_xgrammars_source(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                  extra_body={"structured_outputs": {"grammar": "root ::= foo"}})
    message = info.value.body["message"]
    assert 'Rule "foo" is not defined' in message and ".cc:" not in message, message


def test_responses_report_top_p_one_by_default(client):
    reply = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert reply.top_p == 1.0
