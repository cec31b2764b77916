"""Sleep mode and weight reload on a server in dev mode (RUNTIME_SERVER_DEV_MODE=1) with two
data-parallel replicas: every replica sleeps, wakes and takes the new weights; greedy tokens
after waking equal those before, and after /update_weights those of transformers on the new
folder; requests in flight make them 409."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.server.conftest import API_KEY, TINY_ARGS, Server

PROMPT = [1, 520, 3000, 77, 9, 41, 1200, 64]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def folders(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM"), tiny_model_factory("LlamaForCausalLM", seed=1)


@pytest.fixture(scope="module")
def dev_server(folders, tmp_path_factory):
    server = Server([folders[0], *TINY_ARGS, "--enable-sleep-mode", "--data-parallel-size", "2"],
                    str(tmp_path_factory.mktemp("dev") / "server.log"),
                    env={"RUNTIME_SERVER_DEV_MODE": "1"})
    yield server
    assert server.stop() == 0, server.log()


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def greedy(server) -> list[list[int]]:
    """Two requests, one per replica (the balancer takes turns between idle replicas)."""
    replies = [post(server, "/inference/v1/generate",
                    json={"token_ids": PROMPT[:n], "sampling_params": GREEDY}) for n in (8, 6)]
    assert all(r.status_code == 200 for r in replies), replies[0].text
    return [r.json()["choices"][0]["token_ids"] for r in replies]


def sleeping(server) -> bool:
    return httpx.get(server.url + "/is_sleeping").json()["is_sleeping"]


def hf_greedy(folder: str) -> list[list[int]]:
    """transformers' greedy tokens, 8 per prompt, EOS not stopping them (as ignore_eos)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for n in (8, 6):
            ids = torch.tensor([PROMPT[:n]])
            for _ in range(8):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            out.append(ids[0, n:].tolist())
    return out


def test_each_level_frees_and_wakes_to_the_same_tokens(dev_server):
    before = greedy(dev_server)
    for level, wakes in ((1, [None]), (2, [["weights"], ["kv_cache"]])):
        assert dev_server.metric("vllm:engine_sleep_state", sleep_state="awake") == 1
        assert post(dev_server, f"/sleep?level={level}").status_code == 200
        assert sleeping(dev_server)
        state = {1: "weights_offloaded", 2: "discard_all"}[level]
        assert dev_server.metric("vllm:engine_sleep_state", sleep_state=state) == 1
        assert dev_server.metric("vllm:engine_sleep_state", sleep_state="awake") == 0
        refused = post(dev_server, "/inference/v1/generate",
                       json={"token_ids": PROMPT, "sampling_params": GREEDY})
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
        for tags in wakes:
            assert post(dev_server, "/wake_up", params={"tags": tags} if tags else {}
                        ).status_code == 200
        assert not sleeping(dev_server)
        assert greedy(dev_server) == before, level


def test_update_weights_serves_the_new_folder(dev_server, folders):
    old = greedy(dev_server)
    reply = post(dev_server, "/update_weights", json={"model_path": folders[1]})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    expected = hf_greedy(folders[1])
    assert expected != old
    assert greedy(dev_server) == expected
    assert post(dev_server, "/update_weights", json={"model_path": folders[0]}).status_code == 200
    assert greedy(dev_server) == old


@pytest.mark.parametrize("path, kwargs, named", [
    ("/sleep?level=3", {}, "sleep level must be 1"),
    ("/sleep?level=deep", {}, "level"),
    ("/wake_up?tags=everything", {}, "unknown wake_up tags"),
    ("/update_weights", {"json": {"model_path": "/no/such/folder"}}, "neither a .gguf"),
    ("/update_weights", {"json": {}}, "model_path"),
])
def test_bad_input_is_a_400(dev_server, path, kwargs, named):
    reply = post(dev_server, path, **kwargs)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text


def test_another_architecture_is_refused(dev_server, tiny_model_factory):
    wider = tiny_model_factory("LlamaForCausalLM", intermediate_size=192)
    reply = post(dev_server, "/update_weights", json={"model_path": wider})
    assert reply.status_code == 400 and "intermediate_size" in reply.json()["error"]["message"]


def test_requests_in_flight_are_refused_with_409(dev_server):
    body = {"token_ids": PROMPT, "request_id": "long", "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", dev_server.url + "/inference/v1/generate", timeout=120,
                      json=body) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data:"))
        next(lines)
        for path in ("/sleep?level=1", "/update_weights"):
            refused = post(dev_server, path, json={"model_path": "/x"})
            assert refused.status_code == 409, refused.text
            assert "1 requests are in flight" in refused.json()["error"]["message"]
        post(dev_server, "/abort_requests", json={"request_ids": ["long"]})
        assert json.loads(list(lines)[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert not sleeping(dev_server)


def test_dev_routes_are_absent_without_dev_mode(tiny_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/sleep", "/wake_up", "/update_weights"):
        assert httpx.post(tiny_server.url + path, headers=headers).status_code == 404
    assert httpx.get(tiny_server.url + "/is_sleeping", headers=headers).status_code == 404
