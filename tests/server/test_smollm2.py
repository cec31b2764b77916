"""The embedded default model, SmolLM2-135M-Instruct, served with no model named."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--num-threads", "1"],
                    str(tmp_path_factory.mktemp("smollm2") / "server.log"))
    yield server
    assert server.stop() == 0, server.log()


def test_chat_with_the_default_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           max_tokens=10, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    # The requests below hit the prompt's cached blocks, whose path (attention over the cache)
    # rounds differently in bf16 from the first's: its first two tokens' logits are one bf16
    # step apart, so only requests that take the same path are compared.
    cached = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_tokens=10, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == cached.choices[0].message.content
