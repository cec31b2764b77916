"""The OpenAI Responses API: /v1/responses, with its streaming events. Nothing is stored: a
conversation goes back in as `input` items (messages, function calls and their outputs)."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.engine.async_llm import RequestStream
from runtime.entrypoints.chat import ChatMedia, effort_kwargs, render_chat
from runtime.entrypoints.errors import bad_request
from runtime.entrypoints.reasoning import ReasoningParser
from runtime.entrypoints.responses_protocol import ResponsesRequest
from runtime.entrypoints.serving import (check_model, final_outputs, new_id,
                                         open_streams, sse, state_of, stream_error,
                                         unless_disconnected)
from runtime.entrypoints.tool_parsers import Delta, ToolChoice, template_messages
from runtime.outputs import CompletionOutput

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Any:
    state = state_of(raw)
    model = check_model(state, body.model)
    tools = body.tool_choice_of(state.tool_call_parser, state.enable_auto_tool_choice)
    media = ChatMedia(state.engine.processor.multimodal, "input", state.chat_template)
    try:
        messages = template_messages(body.chat_messages(), media.text_of, "input")
    except ValueError as e:
        raise bad_request(str(e), param="input") from None
    effort = body.reasoning.effort if body.reasoning is not None else None
    prompt = await state.off_loop(render_chat, state.engine.tokenizer, messages,
                                  state.chat_template, True, tools.tools, False,
                                  effort_kwargs(state.engine.tokenizer, state.chat_template,
                                                effort, "reasoning"))
    params = tools.constrain(body.sampling_params(state.engine.processor.sampling_defaults),
                             "text.format")
    if state.reasoning_parser is not None:
        params = state.reasoning_parser.request_params(params)
    response_id = new_id("resp")
    streams = await open_streams(state, response_id, [media.prompt(prompt)], params,
                                 body.stream, max_tokens_param="max_output_tokens", model=model,
                                 raw=raw, constraint_param="tools" if tools.forces_call
                                 else "text")
    reply = ResponseReply(response_id, model, body, tools, streams[0], state.reasoning_parser)
    if body.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await unless_disconnected(raw, reply.response(), streams)


class OutputItems:
    """A response's output items, built from an output's reasoning, content and call deltas
    (a reasoning item for reasoning, a message item for text, a function_call item per call),
    and the streaming events of each step."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.calls: dict[int, int] = {}  # call index -> output index

    def add_reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        last = self.items[-1] if self.items else None
        if last is None or last["type"] != "reasoning" or last["status"] != "in_progress":
            events += self._close_last("completed") + self._open_reasoning()
        index, item = len(self.items) - 1, self.items[-1]
        item["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", "item_id": item["id"],
                          "output_index": index, "content_index": 0, "delta": text}]

    def add(self, delta: Delta) -> list[dict]:
        events = []
        if delta.content:
            last = self.items[-1] if self.items else None
            if last is None or last["type"] != "message" or last["status"] != "in_progress":
                events += self._close_last("completed") + self._open_message()
            index, item = len(self.items) - 1, self.items[-1]
            item["content"][0]["text"] += delta.content
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": index, "content_index": 0,
                           "delta": delta.content, "logprobs": []})
        for call in delta.calls:
            if "id" in call:
                events += self._close_last("completed")
                self.calls[call["index"]] = len(self.items)
                self.items.append({"type": "function_call", "id": new_id("fc"),
                                   "call_id": call["id"], "name": call["function"]["name"],
                                   "arguments": "", "status": "in_progress"})
                events.append({"type": "response.output_item.added",
                               "output_index": len(self.items) - 1, "item": {**self.items[-1]}})
            index = self.calls[call["index"]]
            item, fragment = self.items[index], call["function"]["arguments"]
            item["arguments"] += fragment
            if fragment:
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item["id"], "output_index": index,
                               "delta": fragment})
        return events

    def close(self, status: str) -> list[dict]:
        """The events that end the output; an output with no item gets an empty message."""
        events = [] if self.items else self._open_message()
        return events + self._close_last(status)

    def _open_message(self) -> list[dict]:
        return self._open({"type": "message", "id": new_id("msg"), "status": "in_progress",
                           "role": "assistant", "content": []},
                          {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _open_reasoning(self) -> list[dict]:
        return self._open({"type": "reasoning", "id": new_id("rs"), "status": "in_progress",
                           "summary": [], "content": [], "encrypted_content": None},
                          {"type": "reasoning_text", "text": ""})

    def _open(self, item: dict, part: dict) -> list[dict]:
        """Start an output item with its first content part; the events that announce them."""
        self.items.append(item)
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "content": []}},
                  {"type": "response.content_part.added", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "part": {**part}}]
        item["content"].append(part)
        return events

    def _close_last(self, status: str) -> list[dict]:
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        index, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": part["text"]},
                      {"type": "response.content_part.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "part": part}]
        else:
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"],
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": item}]


def finished_status(sample: CompletionOutput) -> tuple[str, str, dict | None]:
    """(the response's status, its items' status, its error) once `sample` finished: an
    output the engine ended ("abort": a grammar its own controls left no token, a request in
    flight at two core deaths) fails with the reason; one cut by max_output_tokens is
    incomplete."""
    if sample.finish_reason == "abort":
        return "failed", "incomplete", {"code": "server_error",
                                        "message": str(sample.stop_reason or "aborted")}
    status = "incomplete" if sample.finish_reason == "length" else "completed"
    return status, status, None


class ResponseReply:
    """The response object (or its event stream) for one request's engine stream."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, tools: ToolChoice,
                 stream: RequestStream, reasoning: ReasoningParser | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.body = body
        self.tools = tools
        self.stream = stream
        self.reasoning = reasoning  # --reasoning-parser: splits the reasoning off the output
        self.created = int(time.time())
        self.cached_tokens = 0

    def _response(self, status: str, output: list[dict], with_usage: bool = False,
                  error: dict | None = None) -> dict:
        usage = None
        if with_usage:
            prompt, completion = self.stream.num_prompt_tokens, self.stream.num_output_tokens
            usage = {"input_tokens": prompt,
                     "input_tokens_details": {"cached_tokens": self.cached_tokens,
                                              "cache_write_tokens": 0},
                     "output_tokens": completion,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + completion}
        done = status in ("completed", "incomplete")
        return {"id": self.response_id, "object": "response", "created_at": self.created,
                "completed_at": int(time.time()) if done else None, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": usage, **self.body.echo()}

    async def response(self) -> dict:
        output = (await final_outputs([self.stream]))[0]
        self.cached_tokens = output.num_cached_tokens
        sample = output.outputs[0]
        items, text = OutputItems(), sample.text
        if self.reasoning is not None:
            split = self.reasoning.reader().feed(text, final=True)
            items.add_reasoning(split.reasoning)
            text = split.content
        reader = self.tools.reader()
        delta = reader.feed(text).add(reader.finish())
        items.add(Delta(text) if reader.failed else self.tools.limit(delta))
        status, item_status, error = finished_status(sample)
        items.close(item_status)
        return self._response(status, items.items, with_usage=True, error=error)

    async def events(self) -> AsyncIterator[str]:
        """response.created and .in_progress, the output items' events, then
        response.completed (or .incomplete when max_output_tokens cut the output, .failed when
        the engine ended it); an error event in place of the rest if anything fails."""
        sequence = 0

        def event(data: dict) -> str:
            nonlocal sequence
            sequence += 1
            return sse({**data, "sequence_number": sequence - 1}, data["type"])

        try:
            yield event({"type": "response.created",
                         "response": self._response("in_progress", [])})
            yield event({"type": "response.in_progress",
                         "response": self._response("in_progress", [])})
            reader, items, sample = self.tools.reader(), OutputItems(), None
            thinking = self.reasoning.reader() if self.reasoning is not None else None
            async for output in self.stream:
                sample = output.outputs[0]
                self.cached_tokens = output.num_cached_tokens
                text = sample.text
                if thinking is not None:
                    split = thinking.feed(text, final=sample.finished)
                    for data in items.add_reasoning(split.reasoning):
                        yield event(data)
                    text = split.content
                delta = reader.feed(text)
                if sample.finished:
                    delta.add(reader.finish())
                for data in items.add(self.tools.limit(delta)):
                    yield event(data)
            status, item_status, error = finished_status(sample)
            for data in items.close(item_status):
                yield event(data)
            yield event({"type": f"response.{status}", "response": self._response(
                status, items.items, with_usage=True, error=error)})
        except Exception as e:
            error = stream_error(e, self.response_id)
            yield event({"type": "error", "code": error.code, "message": error.message,
                         "param": error.param})
        finally:
            self.stream.close()
