"""vLLM's token-in, token-out route /inference/v1/generate, /abort_requests and Anthropic's
/v1/messages/count_tokens, on the shared tiny server."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [1, 520, 3000, 77, 9, 41]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def generate(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/inference/v1/generate", headers=AUTH, timeout=120,
                      json={"token_ids": PROMPT, "sampling_params": GREEDY, **body})


def test_generate_equals_completions_on_the_same_tokens(tiny_server):
    reply = generate(tiny_server, request_id="tok-1", model="tiny",
                     sampling_params={**GREEDY, "logprobs": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["request_id"] == "tok-1" and body["kv_transfer_params"] is None
    choice = body["choices"][0]
    completion = httpx.post(tiny_server.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 8,
        "ignore_eos": True, "logprobs": 2}).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    text = httpx.post(tiny_server.url + "/detokenize", headers=AUTH,
                      json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert text == completion["text"]
    content = choice["logprobs"]["content"]
    assert len(content) == 8 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert [c["logprob"] for c in content] == pytest.approx(
        completion["logprobs"]["token_logprobs"], abs=1e-4)


def test_streamed_chunks_add_up_to_the_whole(tiny_server):
    whole = generate(tiny_server).json()["choices"][0]["token_ids"]
    with httpx.stream("POST", tiny_server.url + "/inference/v1/generate", headers=AUTH,
                      timeout=120, json={"token_ids": PROMPT, "sampling_params": GREEDY,
                                         "stream": True,
                                         "stream_options": {"include_usage": True}}) as reply:
        events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]] == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 8,
                                   "total_tokens": len(PROMPT) + 8}


@pytest.mark.parametrize("body, named", [
    ({"sampling_params": {"temprature": 0}}, "temprature"),
    ({"sampling_params": {"structured_outputs": {"regexp": "a"}}}, "structured_outputs.regexp"),
    ({"sampling_params": {"top_p": 2}}, "top_p must be in (0, 1]"),
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"sampling_params": {"n": 2}}, "must be 1 on /inference/v1/generate"),
    ({"features": {"mm_hashes": []}}, "features"),
    ({"cache_salt": "x"}, "cache_salt"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [10**9]}, "token"),
    ({"stream_options": {"include_usage": True}}, "stream_options needs stream=true"),
])
def test_bad_requests_are_refused_naming_the_field(tiny_server, body, named):
    reply = generate(tiny_server, **body)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]


def test_abort_requests_ends_a_running_request(tiny_server):
    body = {"token_ids": PROMPT, "request_id": "to-abort", "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", tiny_server.url + "/inference/v1/generate", headers=AUTH,
                      timeout=120, json=body) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data:"))
        next(lines)
        assert generate(tiny_server, request_id="to-abort").status_code == 400  # in flight
        aborted = httpx.post(tiny_server.url + "/abort_requests", headers=AUTH,
                             json={"request_ids": ["to-abort", "unknown"]})
        assert aborted.status_code == 200, aborted.text
        events = list(lines)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events[:-1]) < 899


def test_count_tokens_equals_the_message_prompt(tiny_server):
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key=API_KEY, max_retries=0,
                                 timeout=120)
    messages = [{"role": "user", "content": "Count these words, please."}]
    counted = claude.messages.count_tokens(model="tiny", messages=messages, system="Be brief.")
    reply = claude.messages.create(model="tiny", max_tokens=1, messages=messages,
                                   system="Be brief.")
    assert counted.input_tokens == reply.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.count_tokens(model="tiny", messages=messages,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
