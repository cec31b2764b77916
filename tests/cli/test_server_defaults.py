"""The server side of vLLM's engine options: --generation-config defaults for the fields a
request leaves out, --max-logprobs as a 400, and the periodic stats line."""
from __future__ import annotations

import json
import logging
import os
import shutil

import httpx
import pytest

from tests.server.conftest import TINY_ARGS, Server


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    model = str(root / "model")
    shutil.copytree(tiny_llama, model)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5}, f)
    server = Server([model, *TINY_ARGS, "--served-model-name", "tiny", "--max-logprobs", "2"],
                    str(root / "server.log"))
    yield server
    server.stop()


def chat(server: Server, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_generation_config_fills_what_the_request_leaves_out(server):
    reply = chat(server).json()
    assert reply["usage"]["completion_tokens"] == 5  # max_new_tokens
    again = chat(server).json()  # temperature 0.0 from the model's config: greedy, repeatable
    assert again["choices"][0]["message"] == reply["choices"][0]["message"]
    assert chat(server, max_tokens=3).json()["usage"]["completion_tokens"] == 3
    anthropic = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert anthropic.status_code == 200, anthropic.text


def test_max_logprobs_is_a_400(server):
    assert chat(server, logprobs=True, top_logprobs=2).status_code == 200
    reply = chat(server, logprobs=True, top_logprobs=3)
    assert reply.status_code == 400, reply.text
    assert "at most 2 (--max-logprobs)" in reply.json()["error"]["message"]


def test_stat_logger_logs_throughput_and_forwards(caplog):
    from runtime.engine.core_proc import CoreStats
    from runtime.metrics import Metrics
    from runtime.stat_logger import StatLogger
    metrics = Metrics("tiny")
    stats = StatLogger(metrics, interval=0.0)
    stats.on_core_stats(CoreStats())  # nothing moved yet: no line
    stats.on_request_added(12)
    stats.on_tokens(3)
    with caplog.at_level(logging.INFO, logger="runtime.stats"):
        stats.on_core_stats(CoreStats(num_running=1, num_waiting=2, num_received=3,
                                      kv_cache_usage=0.25, prefix_cache_hit_rate=0.5))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 50.0%" in line
    assert "runtime:prompt_tokens_total{model_name=\"tiny\"} 12.0" in metrics.render().decode()
