"""`prompt_embeds` on /v1/completions (--enable-prompt-embeds), in vLLM's format: base64 of a
torch.save()d tensor. The tiny Llama's own embeddings of a prompt give the prompt's completion;
what cannot be served is a 400 naming the field."""
from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
import transformers

from tests.server.conftest import API_KEY, TINY_ARGS, Server

IDS = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    server = Server([tiny_llama, *TINY_ARGS, "--served-model-name", "tiny",
                     "--enable-prompt-embeds"],
                    str(tmp_path_factory.mktemp("embeds") / "server.log"))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def embeds(tiny_llama) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(IDS)).clone()


def encode(tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


GREEDY = dict(model="tiny", max_tokens=6, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})


def test_base64_embeddings_complete_as_their_token_ids(server, embeds):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    by_ids = client.completions.create(prompt=IDS, **GREEDY).choices[0]
    reply = client.completions.create(
        prompt="", **{**GREEDY, "extra_body": {"ignore_eos": True,
                                               "prompt_embeds": encode(embeds)}})
    assert reply.choices[0].text == by_ids.text
    assert reply.choices[0].logprobs.tokens == by_ids.logprobs.tokens
    for a, b in zip(reply.choices[0].logprobs.token_logprobs, by_ids.logprobs.token_logprobs):
        assert abs(a - b) < 2e-3
    assert reply.usage.prompt_tokens == len(IDS)
    # a batch: the embeddings first (the second a [1, tokens, hidden] batch of one), then
    # the prompts
    both = client.completions.create(prompt=[IDS], **{**GREEDY, "extra_body": {
        "ignore_eos": True, "prompt_embeds": [encode(embeds), encode(embeds[None])]}})
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [by_ids.text] * 3


@pytest.mark.parametrize("body, param, message", [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": base64.b64encode(b"not a tensor").decode()}, "prompt_embeds",
     "torch.save"),
    ({"prompt_embeds": "SHAPE"}, "prompt_embeds", "hidden size 64"),
    ({"prompt_embeds": "EMBEDS", "echo": True}, "echo", "no token ids"),
    ({}, "prompt", "prompt is required"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, embeds, body, param, message):
    values = {"SHAPE": encode(torch.zeros(3, 32)), "EMBEDS": encode(embeds)}
    body = {k: values.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    reply = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_server_without_the_flag_refuses_them_by_name(tiny_server, embeds):
    reply = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "tiny", "prompt": "", "prompt_embeds": encode(embeds)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt_embeds" and "--enable-prompt-embeds" in error["message"]
