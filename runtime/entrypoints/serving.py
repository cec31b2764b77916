"""What every generating route shares: the server's state, admitting requests, merging their
outputs, aborting when the client goes away, and Server-Sent Events."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response

from runtime.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestStream
from runtime.engine.input_processor import PromptType
from runtime.entrypoints.errors import APIError, bad_request
from runtime.metrics import Metrics
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


@dataclass
class ServerState:
    engine: AsyncLLM
    metrics: Metrics
    model_names: list[str]  # the first is the one reported back
    chat_template: str | None
    api_key: str | None


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def new_id(prefix: str, request: Request) -> str:
    """The engine's id for an HTTP request: its X-Request-Id, prefixed."""
    return f"{prefix}-{request.state.request_id}"


def check_model(state: ServerState, model: str | None) -> str:
    """The name to report for a request that asked for `model` (None: the served one)."""
    if model is not None and model not in state.model_names:
        raise APIError(400, f"the model {model!r} does not exist; this server serves "
                       f"{state.model_names}", param="model", code="model_not_found")
    return state.model_names[0]


def open_streams(state: ServerState, request_id: str, prompts: list[PromptType],
                 params: SamplingParams, stream: bool, priority: int = 0) -> list[RequestStream]:
    """Queue one engine request per prompt, all or none: a 400 for bad input, a 503 when the
    waiting queue is full, a 500 when the engine is dead."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(state.engine.add_request(sub_id, prompt, params, priority, stream))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, ValueError):
            raise bad_request(str(e), param="prompt") from None
        if isinstance(e, QueueFullError):
            state.metrics.on_request_rejected()
            raise APIError(503, f"{e}; retry later", type="server_overloaded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        if isinstance(e, EngineDeadError):
            raise APIError(500, str(e), type="internal_server_error") from None
        raise
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as they come, from all streams until each has finished."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of each stream, in order; closes the streams on any exit."""
    try:
        results: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merge(streams):
            results[index] = output
        return results
    finally:
        for s in streams:
            s.close()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any],
                              streams: list[RequestStream]) -> Any:
    """Await `work`; if the client disconnects first, cancel it and abort its `streams`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            for s in streams:
                s.close()
    if task.cancelled():
        logger.info("request %s: the client disconnected; aborted", request.state.request_id)
        return Response(status_code=499)
    return task.result()


def sse(data: Any, event: str | None = None) -> str:
    """One Server-Sent Event; `data` is JSON-encoded unless it is a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def stream_error(e: Exception, request_id: str) -> APIError:
    """An error met after a stream's headers were sent: logged, and sent as the last event."""
    if isinstance(e, APIError):
        return e
    logger.error("request %s failed while streaming: %s", request_id, e)
    return APIError(500, str(e), type="internal_server_error")
