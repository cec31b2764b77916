"""The OpenAI routes, driven by the official `openai` client, against `LLM.generate`."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from runtime import LLM, SamplingParams
from tests.server.conftest import API_KEY

PROMPTS = [f"Prompt number {i}: the {w} of" for i, w in
           enumerate(["history", "science", "art", "music"] * 8)]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", num_threads=1)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_greedy_completions_equal_llm_generate(client, llm, tiny_tokenizer):
    expected = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True))
    result = client.completions.create(model="tiny", prompt=PROMPTS[:4], max_tokens=12, **GREEDY)
    assert [c.text for c in result.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in result.choices] == ["length"] * 4
    prompt_tokens = sum(len(tiny_tokenizer.encode(p)) for p in PROMPTS[:4])
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 4 * 12
    assert result.usage.total_tokens == prompt_tokens + 48


def test_token_prompt_and_echo(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, **GREEDY)
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6,
                                       echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + by_ids.choices[0].text


def test_chat_usage_matches_the_template(client, tiny_server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a river."}]}]
    reply = client.chat.completions.create(model="tiny", messages=messages,
                                           max_completion_tokens=7, **GREEDY)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    counted = httpx.post(tiny_server.url + "/tokenize", json={"messages": messages}).json()
    assert reply.usage.prompt_tokens == counted["count"]
    assert reply.usage.completion_tokens == 7


def test_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                           **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                 stream=True,
                                                 stream_options={"include_usage": True},
                                                 **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""  # as vLLM: the role alone opens the stream
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_samples(client):
    result = client.completions.create(model="tiny", prompt=["a b c", "d e f"], n=3,
                                       max_tokens=5, temperature=1.0, seed=7,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == list(range(6))
    assert result.usage.completion_tokens == 30
    stream = client.chat.completions.create(model="tiny", n=2, max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            temperature=1.0, seed=3,
                                            extra_body={"ignore_eos": True})
    finish_reasons = {choice.index: choice.finish_reason
                      for chunk in stream for choice in chunk.choices if choice.finish_reason}
    assert finish_reasons == {0: "length", 1: "length"}


def test_seed_reproduces(client, llm):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=10,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    local = llm.generate(PROMPTS[5], SamplingParams(temperature=1.0, seed=1234, max_tokens=10))
    assert local[0].outputs[0].text == first


def test_stop_strings(client):
    text = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=24,
                                     **GREEDY).choices[0].text
    stop = text[10:13]
    expected = text[:text.index(stop)]
    stopped = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=24,
                                        stop=[stop], **GREEDY).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=24,
                                         stop=stop, stream=True, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, llm):
    result = client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=6, logprobs=3,
                                       **GREEDY).choices[0].logprobs
    local = llm.generate(PROMPTS[7], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(result.tokens) == len(result.token_logprobs) == 6
    for token_id, position, value, top in zip(local.token_ids, local.logprobs,
                                              result.token_logprobs, result.top_logprobs):
        assert value == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert value == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the best one
        assert len(top) == 3
    chat = client.chat.completions.create(model="tiny", max_tokens=4, logprobs=True,
                                          top_logprobs=2, **GREEDY,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_penalties_and_user_are_accepted(client):
    result = client.completions.create(model="tiny", prompt=PROMPTS[8], max_tokens=8,
                                       presence_penalty=1.5, frequency_penalty=0.5,
                                       user="someone", **GREEDY)
    assert len(result.choices[0].text) > 0


def test_32_concurrent_streams(tiny_server, llm):
    expected = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                                 stream=True, **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY,
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert len(PROMPTS) == 32
    assert asyncio.run(run()) == expected


def test_tokenize_detokenize(tiny_server, tiny_tokenizer):
    ids = httpx.post(tiny_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["tokens"] == tiny_tokenizer.encode("Hello world")
    assert ids["max_model_len"] == 1024
    text = httpx.post(tiny_server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == tiny_tokenizer.decode(ids["tokens"])
