"""The Anthropic Messages API: /v1/messages, with its streaming events."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.engine.async_llm import RequestStream
from runtime.entrypoints.chat import ChatMedia, render_chat, text_of
from runtime.entrypoints.protocol import CountTokensRequest, MessagesRequest
from runtime.entrypoints.reasoning import ReasoningParser
from runtime.entrypoints.tool_parsers import Delta, ToolChoice
from runtime.entrypoints.tool_parsers.anthropic import (anthropic_messages,
                                                        anthropic_tool_choice, content_blocks)
from runtime.entrypoints.serving import (ServerState, check_model, final_outputs, new_id,
                                         open_streams, sse, state_of, stream_error,
                                         unless_disconnected)
from runtime.outputs import CompletionOutput

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request) -> Any:
    state = state_of(raw)
    model = check_model(state, body.model)  # an adapter's name picks that adapter
    prompt, tools = await rendered(state, body)
    params = tools.constrain(body.sampling_params(state.engine.processor.sampling_defaults),
                             "tool_choice")
    reasoning = state.reasoning_parser
    if reasoning is not None:
        params = reasoning.request_params(params)
    message_id = new_id("msg")
    streams = await open_streams(state, message_id, [prompt], params,
                                 body.stream, model=model, raw=raw, constraint_param="tools")
    if body.stream:
        blocks = partial(_tool_blocks, streams[0], tools, reasoning) \
            if tools.reads_calls or reasoning is not None else partial(_text_block, streams[0])
        return StreamingResponse(_events(message_id, body.model, streams[0], blocks),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await unless_disconnected(raw, _message(message_id, body.model, streams, tools,
                                                   reasoning), streams)


async def rendered(state: ServerState, body: MessagesRequest | CountTokensRequest
                   ) -> tuple[dict[str, Any], ToolChoice]:
    """The engine prompt of a Messages request (system, messages and tools through the chat
    template, off the event loop; its images as multi_modal_data), and its tool choice."""
    messages = []
    media = ChatMedia(state.engine.processor.multimodal, chat_template=state.chat_template)
    if body.system is not None:  # text only; as a text part for a template that reads parts
        messages.append({"role": "system", "content": media.text_of(text_of(body.system))})
    messages += anthropic_messages(body.messages, media.text_of)
    tools = anthropic_tool_choice(body, state.tool_call_parser, state.enable_auto_tool_choice)
    prompt = await state.off_loop(render_chat, state.engine.tokenizer, messages,
                                  state.chat_template, True, tools.tools)
    return media.prompt(prompt), tools


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request) -> dict:
    """Anthropic's token count: the prompt /v1/messages would run for the same messages."""
    state = state_of(raw)
    check_model(state, body.model)
    prompt, _ = await rendered(state, body)
    if "multi_modal_data" in prompt:  # each image's placeholders expanded, as /v1/messages runs it
        prompt = (await state.off_loop(state.engine.processor.prepare, prompt))[1]
    else:
        prompt = prompt["prompt_token_ids"]
    return {"input_tokens": len(prompt)}


def _stop(sample: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sample."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.finish_reason == "stop" and isinstance(sample.stop_reason, str):
        return "stop_sequence", sample.stop_reason  # not an abort's reason
    return "end_turn", None


async def _message(message_id: str, model: str, streams: list[RequestStream],
                   tools: ToolChoice, reasoning: ReasoningParser | None) -> dict:
    """The whole message; with a --reasoning-parser, a thinking block first (its signature
    empty: nothing is signed here)."""
    sample = (await final_outputs(streams))[0].outputs[0]
    if reasoning is None:
        message, calls = tools.message(sample.text)
        return _message_body(message_id, model, content_blocks(message), streams[0], sample,
                             calls)
    thought, content = reasoning.reader().read(sample.text)
    message, calls = tools.message(content or "")
    blocks = content_blocks(message)
    if thought is not None:
        blocks = [{"type": "thinking", "thinking": thought, "signature": ""}] + \
            [b for b in blocks if b != {"type": "text", "text": ""}]
    return _message_body(message_id, model, blocks, streams[0], sample, calls)


def _message_body(message_id: str, model: str, content: list[dict], stream: RequestStream,
                  sample: CompletionOutput | None, calls: bool = False) -> dict:
    stop_reason, stop_sequence = _stop(sample) if sample is not None else (None, None)
    if calls:
        stop_reason = "tool_use"
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": stream.num_prompt_tokens,
                      "output_tokens": stream.num_output_tokens}}


async def _events(message_id: str, model: str, stream: RequestStream,
                  blocks: Callable[[dict], AsyncIterator[str]]) -> AsyncIterator[str]:
    """message_start, the content blocks' events, message_delta (stop reason and usage),
    message_stop; an error event in place of the rest if anything fails. `blocks(stop)` yields
    the content events and sets stop["reason"] and stop["sequence"]."""
    stop: dict[str, str | None] = {}
    try:
        yield sse({"type": "message_start",
                   "message": _message_body(message_id, model, [], stream, None)},
                  "message_start")
        async for event in blocks(stop):
            yield event
        yield sse({"type": "message_delta",
                   "delta": {"stop_reason": stop["reason"], "stop_sequence": stop["sequence"]},
                   "usage": {"output_tokens": stream.num_output_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    except Exception as e:
        yield sse(stream_error(e, message_id).body(anthropic=True), "error")
    finally:
        stream.close()


async def _text_block(stream: RequestStream, stop: dict) -> AsyncIterator[str]:
    """One text block, streamed as the tokens come."""
    yield sse({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}, "content_block_start")
    yield sse({"type": "ping"}, "ping")
    sample = None
    async for output in stream:
        sample = output.outputs[0]
        if sample.text:
            yield sse({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": sample.text}},
                      "content_block_delta")
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    stop["reason"], stop["sequence"] = _stop(sample)


async def _tool_blocks(stream: RequestStream, tools: ToolChoice,
                       reasoning: ReasoningParser | None, stop: dict) -> AsyncIterator[str]:
    """An output that may hold reasoning and tool calls, read as it comes (the chat route's
    readers): a thinking block for reasoning, a text block for content, a tool_use block per
    call, its input streamed as input_json_delta fragments of the arguments the model writes."""
    reader, blocks, sample = tools.reader(), ContentBlocks(), None
    thinking = reasoning.reader() if reasoning is not None else None
    async for output in stream:
        sample = output.outputs[0]
        text = sample.text
        if thinking is not None:
            split = thinking.feed(text, final=sample.finished)
            for event in blocks.add_thinking(split.reasoning):
                yield event
            text = split.content
        delta = reader.feed(text)
        if sample.finished:
            delta.add(reader.finish())
        for event in blocks.add(tools.limit(delta)):
            yield event
    for event in blocks.close():
        yield event
    stop["reason"], stop["sequence"] = ("tool_use", None) if blocks.calls else _stop(sample)


class ContentBlocks:
    """A message's content blocks built from content and call deltas, as streaming events."""

    def __init__(self) -> None:
        self.open: str | None = None  # the type of the block being written
        self.index = -1
        self.calls = 0

    def add_thinking(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open != "thinking":
            events += self._start({"type": "thinking", "thinking": "", "signature": ""})
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def add(self, delta: Delta) -> list[str]:
        events = []
        if delta.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.calls:
            if "id" in call:
                self.calls += 1
                events += self._start({"type": "tool_use",
                                       "id": call["id"].replace("call_", "toolu_", 1),
                                       "name": call["function"]["name"], "input": {}})
            if call["function"]["arguments"]:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": call["function"]["arguments"]}))
        return events

    def close(self) -> list[str]:
        """The last block's end; an output with no block gets an empty text block."""
        events = [] if self.index >= 0 else self._start({"type": "text", "text": ""})
        return events + [sse({"type": "content_block_stop", "index": self.index},
                             "content_block_stop")]

    def _start(self, block: dict) -> list[str]:
        events = [] if self.index < 0 else [
            sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]
        self.index += 1
        self.open = block["type"]
        return events + [sse({"type": "content_block_start", "index": self.index,
                              "content_block": block}, "content_block_start")]

    def _delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                   "content_block_delta")
