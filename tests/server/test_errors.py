"""Guarding the door: bad keys, bad requests and vanished clients never hurt other requests."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 1000, "ignore_eos": True}


def test_api_key_is_required_on_v1(tiny_server):
    bad = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    missing = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]
    bad_anthropic = anthropic.Anthropic(base_url=tiny_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_anthropic.messages.create(model="tiny", max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(tiny_server.url + "/health").status_code == 200  # not a /v1 route


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5] * 2000}, "prompt"),  # longer than the 1024-token context
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [10 ** 9]}, "prompt"),  # a token id outside the vocabulary
    ({}, "prompt"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),  # biases are in [-100, 100]
])
def test_bad_requests_are_400_with_a_body(tiny_server, body, param):
    reply = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_malformed_json_is_400(tiny_server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = httpx.post(tiny_server.url + path, content=b'{"prompt": "x",',
                           headers={**AUTH, "Content-Type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["message"]
    reply = httpx.post(tiny_server.url + "/v1/messages", content=b"{", headers={
        "x-api-key": API_KEY, "Content-Type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["type"] == "error"  # the Anthropic shape on the Anthropic route


def test_client_errors_map_to_typed_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", extra_body={"top_k": -5})
    # the engine is unharmed
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text


def _aborts(server) -> float:
    return server.metric("runtime:request_success_total", finished_reason="abort")


def _idle(server) -> bool:
    return server.metric("runtime:num_requests_running") == 0 and \
        server.metric("runtime:kv_cache_usage_perc") == 0


def test_disconnected_stream_is_aborted_and_frees_blocks(tiny_server):
    before = _aborts(tiny_server)
    body = {"prompt": "A long story:", "stream": True, **LONG}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert tiny_server.metric("runtime:kv_cache_usage_perc") > 0
    assert wait_for(lambda: _aborts(tiny_server) == before + 1)
    assert wait_for(lambda: _idle(tiny_server))


def test_disconnected_request_is_aborted_and_frees_blocks(tiny_server):
    before = _aborts(tiny_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "A long story:", **LONG},
                   headers=AUTH, timeout=httpx.Timeout(10, read=0.5))
    assert wait_for(lambda: _aborts(tiny_server) == before + 1)
    assert wait_for(lambda: _idle(tiny_server))


def test_metrics_cover_the_engine(tiny_server, client):
    client.completions.create(model="tiny", prompt="count me", max_tokens=3)
    text = httpx.get(tiny_server.url + "/metrics").text
    for name in ("runtime:num_requests_running", "runtime:num_requests_waiting",
                 "runtime:kv_cache_usage_perc", "runtime:prefix_cache_hit_rate",
                 "runtime:generation_tokens_total", "runtime:prompt_tokens_total",
                 "runtime:time_to_first_token_seconds_bucket",
                 "runtime:time_per_output_token_seconds_bucket",
                 "runtime:e2e_request_latency_seconds_bucket",
                 'runtime:request_success_total{finished_reason="length"'):
        assert name in text, name
    assert tiny_server.metric("runtime:generation_tokens_total") >= 3
