"""The OpenAI API: /v1/completions, /v1/chat/completions and /v1/models."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.beam_search import BeamSearch, BeamSearchGroup
from runtime.engine.async_llm import RequestStream
from runtime.multimodal.wire import decode_tensor
from runtime.entrypoints.chat import ChatMedia, effort_kwargs, render_chat
from runtime.entrypoints.errors import APIError, bad_request
from runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from runtime.entrypoints.reasoning import ReasoningParser, ReasoningReader
from runtime.entrypoints.structured import constraint_field
from runtime.entrypoints.tool_parsers import CallReader, ToolChoice, template_messages
from runtime.entrypoints.serving import (ServerState, check_budget, check_fits, check_model,
                                         final_outputs, merge, new_id,
                                         open_streams, sse, state_of, stream_error,
                                         unless_disconnected)
from runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from runtime.sampling_params import SamplingParams

router = APIRouter()


@router.get("/v1/models")
async def list_models(raw: Request) -> dict:
    state = state_of(raw)
    return {"object": "list", "data": [_model_card(state, name) for name in
                                       state.model_names + list(state.lora_modules)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, raw: Request) -> dict:
    state = state_of(raw)
    if model not in state.model_names and model not in state.lora_modules:
        raise APIError(404, f"the model {model!r} does not exist", param="model",
                       code="model_not_found")
    return _model_card(state, model)


def _model_card(state: ServerState, name: str) -> dict:
    """A LoRA adapter's card names its base model as `parent` and its folder as `root`."""
    lora = state.lora_modules.get(name)
    return {"id": name, "object": "model", "created": state.started, "owned_by": "runtime",
            "root": lora.lora_path if lora else name,
            "parent": state.model_names[0] if lora else None,
            "max_model_len": state.engine.max_model_len}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request) -> Any:
    state = state_of(raw)
    model = check_model(state, body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    prompts = _completion_prompts(body.prompt, body.prompt_embeds is not None)
    if body.prompt_embeds is not None:
        prompts = await state.off_loop(_embeds_prompts, state, body) + prompts
    if body.use_beam_search:
        if model in state.lora_modules:
            raise bad_request("use_beam_search does not run under a LoRA adapter yet",
                              param="use_beam_search")
        work = _beam_search_completion(state, body, model, new_id("cmpl"), prompts)
        return await unless_disconnected(raw, work, [])
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(body.max_tokens, body.logprobs, prompt_logprobs,
                                  state.engine.processor.sampling_defaults)
    request_id = new_id("cmpl")
    streams = await open_streams(state, request_id, prompts, params, body.stream,
                                 body.priority, model=model, raw=raw,
                                 constraint_param=constraint_field(body))
    reply = Reply(request_id, model, "text_completion", state, params.n, streams)
    if body.stream:
        return _event_stream(reply.completion_chunks(body))
    return await unless_disconnected(raw, reply.completion(body), streams)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
    state = state_of(raw)
    model = check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    tools = ToolChoice.of(body, state.tool_call_parser, state.enable_auto_tool_choice)
    media = ChatMedia(state.engine.processor.multimodal, chat_template=state.chat_template)
    messages = template_messages(body.messages, media.text_of)
    template_kwargs = {**(body.chat_template_kwargs or {}), **effort_kwargs(
        state.engine.tokenizer, state.chat_template, body.reasoning_effort, "reasoning_effort")}
    prompt = await state.off_loop(render_chat, state.engine.tokenizer, messages,
                                  state.chat_template, body.add_generation_prompt, tools.tools,
                                  body.continue_final_message, template_kwargs)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    budget = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = body.sampling_params(body.max_completion_tokens or body.max_tokens, logprobs,
                                  defaults=state.engine.processor.sampling_defaults)
    params = tools.constrain(params, "response_format")
    if state.reasoning_parser is not None:
        params = state.reasoning_parser.request_params(params)
    request_id = new_id("chatcmpl")
    streams = await open_streams(state, request_id, [media.prompt(prompt)], params,
                                 body.stream, body.priority, budget, model, raw,
                                 "tools" if tools.forces_call else constraint_field(body))
    reply = Reply(request_id, model, "chat.completion", state, params.n, streams, tools,
                  state.reasoning_parser)
    if body.stream:
        return _event_stream(reply.chat_chunks(body))
    return await unless_disconnected(raw, reply.chat(body), streams)


async def _beam_search_completion(state: ServerState, body: CompletionRequest, model: str,
                                  request_id: str, prompts: list) -> dict:
    """use_beam_search: the n best of best_of (default n) beams per prompt. Each step runs
    every live beam as a one-token request; the prefix cache shares their blocks."""
    inputs = state.engine.processor.inputs
    check_fits(state, len(prompts), SamplingParams(n=body.best_of or body.n))
    searches, texts = [], []
    for prompt in prompts:
        try:
            text, ids = await state.off_loop(inputs.tokenize, prompt)
            inputs.validate(ids, SamplingParams())
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from None
        check_budget(state, ids, body.max_tokens, "max_tokens")
        params = body.beam_search_params(inputs.max_tokens(
            ids, SamplingParams(max_tokens=body.max_tokens)))
        try:
            searches.append(BeamSearch(ids, params, inputs.eos_token_ids))
        except ValueError as e:
            raise bad_request(str(e), param="best_of") from None
        texts.append(text if text is not None else state.engine.tokenizer.decode(ids))
    group, step = BeamSearchGroup(searches), 0
    while not group.done:
        beams = [{"prompt_token_ids": seq} for seq in group.pending()]
        streams = await open_streams(state, f"{request_id}-{step}", beams, group.step_params(),
                                     False, body.priority)
        group.advance(await final_outputs(streams))
        step += 1
    tokenizer = state.engine.tokenizer
    choices, completion_tokens = [], 0
    for index, (search, prompt_text) in enumerate(zip(searches, texts)):
        for rank, seq in enumerate(search.output().sequences[:body.n]):
            text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
            completion_tokens += len(seq.tokens)
            choices.append({"index": index * body.n + rank,
                            "text": prompt_text + text if body.echo else text,
                            "logprobs": None, "finish_reason": seq.finish_reason,
                            "stop_reason": None})
    prompt_tokens = sum(len(s.prompt_token_ids) for s in searches)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _completion_prompts(prompt: str | list | None, has_embeds: bool) -> list:
    if prompt in (None, "") and has_embeds:
        return []
    if prompt is None:
        raise bad_request("prompt is required (or prompt_embeds)", param="prompt")
    if prompt == "":
        raise bad_request("the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _embeds_prompts(state: ServerState, body: CompletionRequest) -> list[dict]:
    """The request's prompt_embeds as prompts; a 400 naming the field for what cannot be
    served (the server started without --enable-prompt-embeds, echo or beam search, which
    need the prompt's tokens, a payload that is not a saved tensor)."""
    if not state.engine.config.enable_prompt_embeds:
        raise bad_request("prompt_embeds needs the server started with --enable-prompt-embeds",
                          param="prompt_embeds")
    for name in ("echo", "use_beam_search"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported with prompt_embeds: the prompt has "
                              "no token ids", param=name)
    encoded = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) \
        else body.prompt_embeds
    try:
        return [{"prompt_embeds": decode_tensor(e, "prompt_embeds")} for e in encoded]
    except ValueError as e:
        raise bad_request(str(e), param="prompt_embeds") from None


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _finish_reason(sample: CompletionOutput) -> str | None:
    """Chat's finish_reason; "abort" (with the reason in stop_reason) as vLLM sends it."""
    if sample.finish_reason in (None, "length", "abort"):
        return sample.finish_reason
    return "stop"


class Reply:
    """Builds the response (or the event stream) of one OpenAI request from its engine streams:
    one per prompt, each with n samples; choice index = prompt index * n + sample index."""

    def __init__(self, request_id: str, model: str, object: str, state: ServerState, n: int,
                 streams: list[RequestStream], tools: ToolChoice | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.object = object
        self.tokenizer = state.engine.tokenizer
        self.n = n
        self.streams = streams
        self.tools = tools  # a chat request's tool choice: reads calls from the output
        self.reasoning = reasoning  # --reasoning-parser: splits the reasoning off the output
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], usage: dict | None = None,
                  chunk: bool = False) -> dict:
        """The response body around `choices`; a chunk carries usage only when given."""
        kind = "chat.completion.chunk" if chunk and self.object == "chat.completion" \
            else self.object
        body = {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    def _usage(self) -> dict:
        prompt = sum(s.num_prompt_tokens for s in self.streams)
        completion = sum(s.num_output_tokens for s in self.streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    # /v1/completions

    def _with_kv_transfer_params(self, body: dict, output: RequestOutput) -> dict:
        """As vLLM: a prefill instance's response says where its KV is (for the proxy)."""
        if output.kv_transfer_params is not None:
            body["kv_transfer_params"] = output.kv_transfer_params
        return body

    async def completion(self, body: CompletionRequest) -> dict:
        choices = []
        outputs = await final_outputs(self.streams)
        for index, output in enumerate(outputs):
            for sample in output.outputs:
                text, logprobs = sample.text, None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(sample.logprobs, sample.token_ids, 0)
                if body.echo:
                    text = self._prompt_text(output) + text
                    if logprobs is not None:
                        logprobs = self._echo_logprobs(output, logprobs)
                choices.append({"index": index * self.n + sample.index, "text": text,
                                "logprobs": logprobs, "finish_reason": _finish_reason(sample),
                                "stop_reason": sample.stop_reason})
        return self._with_kv_transfer_params(
            self._envelope(sorted(choices, key=lambda c: c["index"]), self._usage()), outputs[0])

    def completion_chunks(self, body: CompletionRequest) -> AsyncIterator[str]:
        return self._events(self._completion_choices(body), body.include_usage)

    async def _completion_choices(self, body: CompletionRequest) -> AsyncIterator[list[dict]]:
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        async for index, output in merge(self.streams):
            choices = []
            for sample in output.outputs:
                choice = index * self.n + sample.index
                text, logprobs = sample.text, None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(sample.logprobs, sample.token_ids,
                                                         offsets.get(choice, 0))
                if body.echo and choice not in offsets:
                    text = self._prompt_text(output) + text
                    if logprobs is not None:
                        logprobs = self._echo_logprobs(output, logprobs)
                offsets[choice] = offsets.get(choice, 0) + len(text)
                if text or sample.token_ids or sample.finished:
                    choices.append({"index": choice, "text": text, "logprobs": logprobs,
                                    "finish_reason": _finish_reason(sample),
                                    "stop_reason": sample.stop_reason})
            yield choices

    async def _events(self, batches: AsyncIterator[list[dict]],
                      include_usage: bool) -> AsyncIterator[str]:
        """A stream's server-sent events: one chunk per non-empty batch of choices, the usage
        chunk when asked, then [DONE]; an error event in place of the rest if anything fails.
        The engine streams are closed however the stream ends."""
        try:
            async for choices in batches:
                if choices:
                    yield sse(self._envelope(choices, chunk=True))
            if include_usage:
                yield sse(self._envelope([], self._usage(), chunk=True))
            yield sse("[DONE]")
        except Exception as e:
            yield sse(stream_error(e, self.request_id).body())
        finally:
            for s in self.streams:
                s.close()

    def _completion_logprobs(self, positions: list[PositionLogprobs | None] | None,
                             token_ids: list[int], offset: int) -> dict:
        """The legacy completions logprobs: tokens, their logprobs, the top alternatives (and
        the chosen token) at each position, and each token's character offset."""
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        for token_id, position in zip(token_ids, positions or []):
            if position is None:  # the first prompt token has no logprob
                token, logprob, top = self.tokenizer.decode([token_id]), None, None
            else:
                token = position[token_id].decoded_token
                logprob = position[token_id].logprob
                top = {p.decoded_token: p.logprob for p in position.values()}
            result["tokens"].append(token)
            result["token_logprobs"].append(logprob)
            result["top_logprobs"].append(top)
            result["text_offset"].append(offset)
            offset += len(token)
        return result

    def _echo_logprobs(self, output: RequestOutput, generated: dict) -> dict:
        prompt = self._completion_logprobs(output.prompt_logprobs, output.prompt_token_ids, 0)
        shift = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
        generated["text_offset"] = [o + shift for o in generated["text_offset"]]
        return {key: prompt[key] + generated[key] for key in prompt}

    # /v1/chat/completions

    async def chat(self, body: ChatCompletionRequest) -> dict:
        output = (await final_outputs(self.streams))[0]
        choices = []
        for sample in output.outputs:
            if self.reasoning is None:
                message, calls = self.tools.message(sample.text)
            else:
                reasoning, content = self.reasoning.reader().read(sample.text)
                message, calls = self.tools.message(content or "")
                message["content"] = message["content"] or None
                message["reasoning"] = reasoning
            choices.append({"index": sample.index, "message": message,
                            "logprobs": self._chat_logprobs(sample, body.top_logprobs or 0)
                            if body.logprobs else None,
                            "finish_reason": "tool_calls" if calls else _finish_reason(sample),
                            "stop_reason": sample.stop_reason})
        return self._with_kv_transfer_params(self._envelope(choices, self._usage()), output)

    def chat_chunks(self, body: ChatCompletionRequest) -> AsyncIterator[str]:
        return self._events(self._chat_choices(body), body.include_usage)

    async def _chat_choices(self, body: ChatCompletionRequest) -> AsyncIterator[list[dict]]:
        """As vLLM: each choice opens with a chunk of its role and empty content alone; then
        the deltas of reasoning (with a --reasoning-parser), content and tool calls."""
        for index in range(self.n):
            yield [{"index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]
        readers: dict[int, CallReader] = {}  # per sample: its calls, read as they are written
        thinking: dict[int, ReasoningReader] = {}  # per sample: its reasoning
        called: set[int] = set()  # samples that made calls
        async for _, output in merge(self.streams):
            choices = []
            for sample in output.outputs:
                delta: dict[str, Any] = {}
                text = sample.text
                if self.reasoning is not None:
                    split = thinking.setdefault(sample.index, self.reasoning.reader()) \
                        .feed(text, final=sample.finished)
                    if split.reasoning:
                        delta["reasoning"] = split.reasoning
                    text = split.content
                if self.tools.reads_calls:
                    reader = readers.setdefault(sample.index, self.tools.reader())
                    read = reader.feed(text)
                    if sample.finished:
                        read.add(reader.finish())
                    read = self.tools.limit(read)
                    if read.content:
                        delta["content"] = read.content
                    if read.calls:
                        delta["tool_calls"] = read.calls
                        called.add(sample.index)
                elif text:
                    delta["content"] = text
                logprobs = self._chat_logprobs(sample, body.top_logprobs or 0) \
                    if body.logprobs and sample.token_ids else None
                if delta or logprobs or sample.finished:
                    calls = sample.finished and sample.index in called \
                        and not readers[sample.index].failed
                    choices.append({"index": sample.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": "tool_calls" if calls
                                    else _finish_reason(sample),
                                    "stop_reason": sample.stop_reason})
            yield choices

    def _chat_logprobs(self, sample: CompletionOutput, top: int) -> dict:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        content = []
        for token_id, position in zip(sample.token_ids, sample.logprobs or []):
            chosen = position[token_id]
            ranked = sorted(position.values(), key=lambda p: p.rank)[:top]
            content.append({**entry(chosen.decoded_token, chosen.logprob),
                            "top_logprobs": [entry(p.decoded_token, p.logprob) for p in ranked]})
        return {"content": content}
