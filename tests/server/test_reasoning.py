"""--reasoning-parser: the split of an output into reasoning and content (vLLM's rules, the same
streamed or whole), `reasoning` on chat messages and deltas, reasoning items on /v1/responses,
and structured outputs held back until the reasoning ends. The server runs a tiny random Qwen3
whose tokenizer has <think> and </think> tokens and a template that closes the thinking in the
prompt when chat_template_kwargs asks enable_thinking false, and that reads reasoning_effort."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from runtime.entrypoints.reasoning import REASONING_PARSERS
from runtime.entrypoints.errors import APIError
from runtime.sampling_params import SamplingParams
from runtime.structured_output.params import StructuredOutputsParams
from tests.conftest import TINY
from tests.server.conftest import TINY_ARGS, Server

TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{%- endif %}{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{%- endif %}{%- endif %}")
ASK = [{"role": "user", "content": "Is it raining?"}]

# vLLM's rules (vllm/reasoning: the base thinking parser for deepseek_r1, Qwen3's own
# extract_reasoning), on the outputs where its streaming and non-streaming answers agree.
VLLM_CASES = [
    ("deepseek_r1", "<think>R</think>C", ("R", "C")),
    ("deepseek_r1", "R</think>C", ("R", "C")),
    ("deepseek_r1", "R</think>", ("R", None)),
    ("deepseek_r1", "just thinking", ("just thinking", None)),
    ("deepseek_r1", "</think>C", ("", "C")),
    ("qwen3", "<think>R</think>C", ("R", "C")),
    ("qwen3", "<think></think>\n\nC", ("", "\n\nC")),
    ("qwen3", "no thinking", (None, "no thinking")),
    ("qwen3", "R</think>C", (None, "R</think>C")),
    # granite_reasoning_parser: phrases, "Here's" as well as "Here is"
    ("granite", "Here is my thought process:R Here is my response:C", ("R ", "C")),
    ("granite", "Here's my thought process:\nR\nHere's my response:\nC", ("\nR\n", "\nC")),
    ("granite", "Here is my thought process:R Here is my response:", ("R ", None)),
    ("granite", "Here is my answer: C", (None, "Here is my answer: C")),
    # gptoss_reasoning_parser: harmony's analysis channel, then the final one
    ("openai_gptoss", "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>"
     "final<|message|>C", ("R", "C")),
    ("openai_gptoss", "<|channel|>final<|message|>C", (None, "C")),
    ("openai_gptoss", "<|channel|>analysis<|message|>R", ("R", None)),
    ("openai_gptoss", "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.f <|constrain|>json<|message|>{}<|call|>", ("R", None)),
]


@pytest.mark.parametrize("family, output, expected", VLLM_CASES)
def test_split_follows_vllms_rules_streamed_or_whole(family, output, expected):
    parser = REASONING_PARSERS[family]
    assert parser.reader().read(output) == expected
    for size in (1, 2, 3, 7):  # deltas cut anywhere, markers included
        reader = parser.reader()
        pieces = [output[i:i + size] for i in range(0, len(output), size)] or [""]
        splits = [reader.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(s.reasoning for s in splits) == (expected[0] or "")
        assert "".join(s.content for s in splits) == (expected[1] or "")


@pytest.fixture(scope="module")
def thinking_model(tokenizer_dir, tmp_path_factory) -> str:
    import torch
    import transformers
    path = str(tmp_path_factory.mktemp("thinking"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = transformers.Qwen3Config(**{**TINY, "num_hidden_layers": 1, "head_dim": 16},
                                      vocab_size=len(tokenizer))
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(thinking_model, tmp_path_factory):
    server = Server([thinking_model, *TINY_ARGS, "--served-model-name", "thinker",
                     "--reasoning-parser", "deepseek_r1"],
                    str(tmp_path_factory.mktemp("reasoning") / "server.log"))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tokenizer(thinking_model):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(thinking_model)


@pytest.fixture(scope="module")
def end_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("</think>")


def raw_text(server, messages: list[dict], **sampling) -> str:
    """The output unparsed: /v1/completions on the chat route's own prompt."""
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "temperature": 0, "skip_special_tokens": False, **sampling})
    return reply.json()["choices"][0]["text"]


def test_chat_and_responses_split_the_output(server, client, end_id):
    """The end marker is made likely enough to come mid-output: reasoning before it, content
    after, on chat (whole and streamed, the stream opening with the role alone) and on
    /v1/responses (a reasoning item, then the message)."""
    sampling = {"max_tokens": 12, "logit_bias": {str(end_id): 6.0}}
    text = raw_text(server, ASK, **sampling)
    reasoning, content = text.split("</think>", 1)
    assert reasoning and content, text  # the bias puts the marker mid-output
    reply = client.chat.completions.create(model="thinker", messages=ASK, temperature=0,
                                           extra_body=sampling)
    message = reply.choices[0].message
    assert (message.reasoning, message.content) == (reasoning, content)
    chunks = list(client.chat.completions.create(model="thinker", messages=ASK, temperature=0,
                                                 stream=True, extra_body=sampling))
    first = chunks[0].choices[0]
    assert first.delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
    deltas = [c.choices[0].delta for c in chunks[1:] if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_responses_give_a_reasoning_item(server, client, tokenizer):
    """Without a </think> of its own, a deepseek_r1 output is all reasoning: one reasoning
    item, whole and streamed (its reasoning_text events), and no message."""
    text = raw_text(server, ASK, max_tokens=12)
    reasoning, content = REASONING_PARSERS["deepseek_r1"](tokenizer).reader().read(text)
    response = client.responses.create(model="thinker", input=ASK, temperature=0,
                                       max_output_tokens=12)
    item = response.output[0]
    assert item.type == "reasoning" and item.content[0].text == reasoning
    assert [o.type for o in response.output] == ["reasoning"] + (["message"] if content else [])
    events = list(client.responses.create(model="thinker", input=ASK, temperature=0,
                                          max_output_tokens=12, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [reasoning]
    assert events[-1].response.output[0].content[0].text == reasoning


def test_grammar_starts_after_the_reasoning(client, end_id):
    """vLLM's rule: the grammar applies once the reasoning has ended. The end marker, pushed
    to the top, is taken first (the grammar would refuse it), then the grammar chooses; with
    the thinking closed in the prompt (enable_thinking false) the grammar holds from the
    first token and the marker never comes."""
    extra = {"logit_bias": {str(end_id): 100}, "structured_outputs": {"choice": ["yes", "no"]}}
    reply = client.chat.completions.create(model="thinker", messages=ASK, temperature=0,
                                           max_tokens=8, extra_body=extra)
    message = reply.choices[0].message
    assert message.reasoning == "" and message.content in ("yes", "no"), message
    closed = client.chat.completions.create(
        model="thinker", messages=ASK, temperature=0, max_tokens=8,
        extra_body={**extra, "chat_template_kwargs": {"enable_thinking": False}})
    # deepseek_r1 reads an output without </think> as reasoning, as vLLM does
    assert closed.choices[0].message.reasoning in ("yes", "no"), closed.choices[0].message


def test_earlier_reasoning_goes_back_to_the_template(server):
    """An assistant message's `reasoning` reaches the template (as reasoning_content)."""
    messages = ASK + [{"role": "assistant", "content": "No.", "reasoning": "Dry sky."},
                      {"role": "user", "content": "Sure?"}]
    prompt = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    without = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{**m, "reasoning": None} for m in messages],
        "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert prompt > without


def test_reasoning_effort_reaches_a_template_that_reads_it(server, client):
    """As vLLM: chat's reasoning_effort (and Responses' reasoning.effort) is a template
    variable; a template that does not read it refuses it (test_request_fields)."""
    def prompt_tokens(**extra) -> int:
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "max_tokens": 1, **extra}).json()["usage"]["prompt_tokens"]
    plain, low = prompt_tokens(), prompt_tokens(reasoning_effort="low")
    assert low > plain
    assert prompt_tokens(chat_template_kwargs={"reasoning_effort": "low"}) == low
    response = client.responses.create(model="thinker", input=ASK, max_output_tokens=1,
                                       reasoning={"effort": "low"})
    assert response.usage.input_tokens == low and response.reasoning.effort == "low"


def test_a_parser_needs_its_markers(tokenizer_dir):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)  # SmolLM2's: none
    with pytest.raises(ValueError, match="no token <think> or </think>"):
        REASONING_PARSERS["qwen3"](tokenizer)


def test_harmony_text_outside_its_channels(tokenizer_dir):
    """Not harmony at all: content. A header still arriving is held back, never shown."""
    parser = REASONING_PARSERS["openai_gptoss"]
    assert parser.reader().read("plain text") == (None, "plain text")
    reader = parser.reader()
    assert reader.feed("Hi<|start|>assistant<|chan").content == "Hi"
    assert reader.feed("nel|>final<|message|>Yes").content == "Yes"


def test_parsers_of_phrases_or_headers_refuse_a_grammar(tokenizer_dir):
    """granite's and gpt-oss's reasoning ends with no single token to start a grammar at: a
    400. gpt-oss requests keep the special tokens that frame harmony's channels."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match=re.escape("no token <|channel|>")):
        REASONING_PARSERS["openai_gptoss"](tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|channel|>", "<|message|>", "<|end|>", "<|start|>"]})
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    for name in ("granite", "openai_gptoss"):
        parser = REASONING_PARSERS[name](tokenizer)
        with pytest.raises(APIError, match=f"--reasoning-parser {name}"):
            parser.request_params(constrained)
    assert parser.request_params(SamplingParams()).skip_special_tokens is False


def test_the_flags_choices_are_the_registry():
    from runtime.cli.serve import REASONING_PARSER_NAMES
    assert REASONING_PARSER_NAMES == tuple(REASONING_PARSERS)


def test_anthropic_messages_give_a_thinking_block(server, tokenizer):
    """The reasoning as a thinking block before the text, whole and streamed; a thinking block
    sent back reaches the template as the assistant's reasoning."""
    import anthropic
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    text = raw_text(server, ASK, max_tokens=12)
    reasoning, content = REASONING_PARSERS["deepseek_r1"](tokenizer).reader().read(text)
    greedy = {"extra_body": {"temperature": 0}}  # recent clients no longer send it
    reply = claude.messages.create(model="thinker", max_tokens=12, messages=ASK, **greedy)
    assert reply.content[0].type == "thinking" and reply.content[0].thinking == reasoning
    assert [b.type for b in reply.content] == ["thinking"] + (["text"] if content else [])
    with claude.messages.stream(model="thinker", max_tokens=12, messages=ASK,
                                **greedy) as stream:
        streamed = stream.get_final_message()
    assert streamed.content == reply.content
    back = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Dry sky.", "signature": ""},
        {"type": "text", "text": "No."}]}, {"role": "user", "content": "Sure?"}]
    without = ASK + [{"role": "assistant", "content": "No."}, {"role": "user", "content": "Sure?"}]
    count = [claude.messages.create(model="thinker", max_tokens=1, messages=m).usage.input_tokens
             for m in (back, without)]
    assert count[0] > count[1]
