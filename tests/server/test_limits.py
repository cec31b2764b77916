"""A server started from a --config file, with one sequence slot and a one-place queue: the
chat-template override, and 503 when the queue is full."""
from __future__ import annotations

import httpx
import pytest
import yaml

from tests.server.conftest import Server, wait_for

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
LONG = {"model": "tiny-b", "prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    (folder / "template.jinja").write_text(TEMPLATE)
    config = {"model": tiny_llama, "dtype": "float32", "kv-cache-memory": "16MiB",
              "num_threads": 1, "max_num_seqs": 1, "max_queue_len": 1,
              "served_model_name": "from-the-file", "chat_template": str(folder / "template.jinja")}
    (folder / "serve.yaml").write_text(yaml.safe_dump(config))
    server = Server(["--config", str(folder / "serve.yaml"), "--served-model-name", "tiny-b"],
                    str(folder / "server.log"))
    yield server
    assert server.stop() == 0, server.log()


def test_config_file_and_flags(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny-b"]  # the flag wins over the file


def test_chat_template_override(server):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<system>S\n<user>U\n<assistant>"


def _data_lines(reply: httpx.Response):
    return (line[5:].strip() for line in reply.iter_lines() if line.startswith("data:"))


def test_full_queue_answers_503(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as running:
            events = _data_lines(running)  # (closing this generator would close the stream)
            next(events)  # the only slot is taken
            with http.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200
                assert wait_for(lambda: server.metric("runtime:num_requests_waiting") == 1)
                refused = http.post("/v1/completions", json={**LONG, "stream": False})
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert "queue" in refused.json()["error"]["message"]
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)
    done = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "again", "max_tokens": 3})
    assert done.status_code == 200 and server.metric("runtime:request_rejected_total") == 1
