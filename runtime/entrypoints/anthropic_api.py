"""The Anthropic Messages API: /v1/messages, with its streaming events."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.engine.async_llm import RequestStream
from runtime.entrypoints.chat import render_chat, text_of
from runtime.entrypoints.protocol import MessagesRequest
from runtime.entrypoints.serving import (check_model, final_outputs, new_id, open_streams, sse,
                                         state_of, stream_error, unless_disconnected)
from runtime.outputs import CompletionOutput

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request) -> Any:
    state = state_of(raw)
    check_model(state, body.model)
    messages = []
    if body.system is not None:
        messages.append({"role": "system", "content": text_of(body.system)})
    messages += [{"role": m.role, "content": text_of(m.content)} for m in body.messages]
    prompt = await state.off_loop(render_chat, state.engine.tokenizer, messages,
                                  state.chat_template)
    message_id = new_id("msg")
    streams = await open_streams(state, message_id, [{"prompt_token_ids": prompt}],
                                 body.sampling_params(state.engine.processor.sampling_defaults),
                                 body.stream)
    if body.stream:
        return StreamingResponse(_events(message_id, body.model, streams[0]),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await unless_disconnected(raw, _message(message_id, body.model, streams), streams)


def _stop(sample: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sample."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if isinstance(sample.stop_reason, str):
        return "stop_sequence", sample.stop_reason
    return "end_turn", None


async def _message(message_id: str, model: str, streams: list[RequestStream]) -> dict:
    sample = (await final_outputs(streams))[0].outputs[0]
    return _message_body(message_id, model, [{"type": "text", "text": sample.text}],
                         streams[0], sample)


def _message_body(message_id: str, model: str, content: list[dict], stream: RequestStream,
                  sample: CompletionOutput | None) -> dict:
    stop_reason, stop_sequence = _stop(sample) if sample is not None else (None, None)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": stream.num_prompt_tokens,
                      "output_tokens": stream.num_output_tokens}}


async def _events(message_id: str, model: str, stream: RequestStream) -> AsyncIterator[str]:
    """message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta (stop reason and usage), message_stop."""
    try:
        yield sse({"type": "message_start",
                   "message": _message_body(message_id, model, [], stream, None)},
                  "message_start")
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
        stop_reason, stop_sequence = _stop(sample)
        yield sse({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": {"output_tokens": stream.num_output_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    except Exception as e:
        yield sse(stream_error(e, message_id).body(anthropic=True), "error")
    finally:
        stream.close()
