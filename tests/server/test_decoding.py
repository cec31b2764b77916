"""The completions route's decoding options: use_beam_search (n of best_of beams) and best_of."""
from __future__ import annotations

import httpx
import pytest

from runtime import LLM, BeamSearchParams

from tests.server.conftest import API_KEY

PROMPT = [1, 504, 3458, 282, 4649, 314]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB")


def test_beam_search_equals_llm_beam_search(tiny_server, llm):
    reply = post(tiny_server, {"prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 3,
                               "max_tokens": 5, "temperature": 0, "length_penalty": 0.5})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    expected = llm.beam_search([{"prompt_token_ids": PROMPT}],
                               BeamSearchParams(beam_width=3, max_tokens=5,
                                                length_penalty=0.5))[0].sequences[:2]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [s.text for s in expected]
    assert reply.json()["usage"]["completion_tokens"] == sum(len(s.tokens) for s in expected)


def test_best_of_returns_n_choices(tiny_server):
    reply = post(tiny_server, {"prompt": PROMPT, "n": 2, "best_of": 4, "max_tokens": 4,
                               "temperature": 1.0, "seed": 3})
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1]


@pytest.mark.parametrize("body,param,message", [
    ({"use_beam_search": True, "temperature": 0.7}, "temperature", "not supported with"),
    ({"use_beam_search": True, "stream": True}, "stream", "cannot be streamed"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "n", "need 1 <= n <= best_of"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, None, ""),
    ({"n": 1, "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ({"n": 1, "best_of": 3, "temperature": 0}, "best_of", "greedy"),
])
def test_bad_decoding_options_are_400(tiny_server, body, param, message):
    reply = post(tiny_server, {"prompt": PROMPT, "max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if param is not None:
        assert error["param"] == param and message in error["message"], error
