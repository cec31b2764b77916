"""`runtime serve --enable-lora --lora-modules ...` driven by the openai client: the adapter is
chosen by the request's `model`, concurrently with the base; adapters load and unload at run time
behind --enable-runtime-lora-updating."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lora_reference import MAX_TOKENS, PROMPTS
from tests.server.conftest import TINY_ARGS, Server


@pytest.fixture(scope="module")
def server(lora_setup, tmp_path_factory):
    base, requests, _ = lora_setup
    log = str(tmp_path_factory.mktemp("lora_server") / "server.log")
    qv = f"qv={requests['qv'].lora_path}"
    mlp = json.dumps({"name": "mlp", "path": requests["mlp"].lora_path})
    server = Server([base, *TINY_ARGS, "--served-model-name", "tiny", "--enable-lora",
                     "--max-loras", "2", "--lora-modules", qv, mlp,
                     "--enable-runtime-lora-updating"], log)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def complete(client, model: str, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert reply.model == model
    # the tiny tokenizer's words: "<unk>" "<s>" "</s>", then "w3" ... for ids 3 ...
    special = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return [special[t] if t in special else int(t.removeprefix("w"))
            for t in reply.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "qv", "mlp"}
    assert cards["qv"].parent == "tiny" and cards["tiny"].parent is None


def test_model_picks_the_adapter_concurrently(client, lora_setup):
    _, _, refs = lora_setup
    jobs = [(model, i) for model in ("tiny", "qv", "mlp") for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        tokens = list(pool.map(lambda job: complete(client, job[0], PROMPTS[job[1]]), jobs))
    for (model, i), got in zip(jobs, tokens):
        assert got == refs[{"tiny": None}.get(model, model)][i][0], (model, i)


def test_load_and_unload_at_run_time(server, client, lora_setup, tmp_path):
    _, requests, refs = lora_setup
    url = server.url + "/v1"
    bad = httpx.post(url + "/load_lora_adapter",
                     json={"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
    assert bad.status_code == 400 and "no folder at" in bad.json()["error"]["message"]
    ok = httpx.post(url + "/load_lora_adapter",
                    json={"lora_name": "all", "lora_path": requests["all"].lora_path})
    assert ok.status_code == 200, ok.text
    assert complete(client, "all", PROMPTS[0]) == refs["all"][0][0]
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
    import openai
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # as vLLM: a 404
        complete(client, "all", PROMPTS[0])
    assert httpx.post(url + "/unload_lora_adapter",
                      json={"lora_name": "all"}).status_code == 404


def test_beam_search_under_an_adapter_is_refused(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model="qv", prompt=PROMPTS[0], max_tokens=2,
                                  extra_body={"use_beam_search": True, "n": 2})


def test_an_adapter_gone_or_corrupt_after_loading_fails_only_its_requests(server, client,
                                                                           lora_setup, tmp_path):
    """Gone: a 400 when a request names it. Corrupt (read by the worker only when a request
    runs): that request fails with the error in an OpenAI error body. Others serve on."""
    import openai
    _, requests, refs = lora_setup
    for name in ("gone", "corrupt"):
        shutil.copytree(requests["all"].lora_path, tmp_path / name)
        assert httpx.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": str(tmp_path / name)}
                          ).status_code == 200
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'gone': no folder at"):
        complete(client, "gone", PROMPTS[0])
    with pytest.raises(openai.InternalServerError, match="LoRA adapter 'corrupt': cannot read"):
        complete(client, "corrupt", PROMPTS[0])
    assert complete(client, "qv", PROMPTS[0]) == refs["qv"][0][0]
