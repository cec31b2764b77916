"""Disaggregated prefill over HTTP: a prefill server (kv_producer) and a decode server
(kv_consumer) sharing a folder through the SharedStorageConnector, behind `runtime
disagg-proxy`, give the official client the greedy tokens and logprobs of one server, streamed
or not, on completions and chat; bad kv_transfer_params are a 400 naming them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import REPO, TINY_ARGS, Server, free_port, wait_for

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun"
GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CLIENT_GREEDY = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                 "extra_body": {"ignore_eos": True}}


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def disagg(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")

    def server(role: str) -> Server:
        config = {"kv_connector": "SharedStorageConnector", "kv_role": role,
                  "kv_connector_extra_config": {"shared_storage_path": str(root / "kv")}}
        return Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny",
                       "--kv-transfer-config", json.dumps(config)], str(root / f"{role}.log"))

    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(server, ("kv_producer", "kv_consumer"))
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "runtime.cli.main", "disagg-proxy",
                              "--prefill", prefill.url, "--decode", decode.url, "--port",
                              str(port)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: healthy(url), timeout=60)
    yield prefill, decode, url, root / "kv"
    proxy.terminate()
    proxy.wait(30)
    prefill.stop()
    decode.stop()


def test_the_proxy_gives_the_tokens_of_one_server(disagg):
    prefill, decode, url, folder = disagg
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    alone = httpx.post(prefill.url + "/v1/completions", timeout=60,
                       json={**GREEDY, "prompt": PROMPT, "logprobs": 0}).json()
    assert "kv_transfer_params" not in alone
    reply = client.completions.create(prompt=PROMPT, logprobs=0, **CLIENT_GREEDY)
    assert reply.choices[0].text == alone["choices"][0]["text"]
    for a, b in zip(alone["choices"][0]["logprobs"]["token_logprobs"],
                    reply.choices[0].logprobs.token_logprobs):
        assert abs(a - b) < 2e-3
    assert os.listdir(folder)  # the prefill server saved the prompt's blocks there
    assert decode.metric("runtime:kv_offload_bytes_total", direction="load") > 0
    stream = client.completions.create(prompt=PROMPT, stream=True, **CLIENT_GREEDY)
    assert "".join(c.choices[0].text for c in stream) == alone["choices"][0]["text"]

    messages = [{"role": "user", "content": PROMPT}]
    alone = httpx.post(prefill.url + "/v1/chat/completions", timeout=60,
                       json={**GREEDY, "messages": messages}).json()
    reply = client.chat.completions.create(messages=messages, **CLIENT_GREEDY)
    assert reply.choices[0].message.content == alone["choices"][0]["message"]["content"]
    stream = client.chat.completions.create(messages=messages, stream=True,
                                            **CLIENT_GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        alone["choices"][0]["message"]["content"]


def test_the_prefill_response_says_where_the_kv_is(disagg):
    prefill, _, _, _ = disagg
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()[
        "kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] > 0
    reply = httpx.post(prefill.url + "/v1/completions", json={**body, "stream": True},
                       timeout=60)
    assert reply.status_code == 400 and "stream=false" in reply.json()["error"]["message"]


@pytest.mark.parametrize("params, words", [
    ({"do_remote_decode": True}, "needs a prefill instance"),
    ({"do_remote_prefill": True, "bogus": 1}, "unknown keys ['bogus']"),
    ("yes", "valid dictionary"),
])
def test_bad_kv_transfer_params_are_a_400(disagg, params, words):
    _, decode, url, _ = disagg
    reply = httpx.post(decode.url + "/v1/completions", timeout=30,
                       json={**GREEDY, "prompt": PROMPT, "kv_transfer_params": params})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "kv_transfer_params" and words in error["message"], error
    reply = httpx.post(url + "/v1/completions", timeout=30,
                       json={**GREEDY, "prompt": PROMPT, "kv_transfer_params": params})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "kv_transfer_params"
