"""What every generating route shares: the server's state, admitting requests, merging their
outputs, aborting when the client goes away, and Server-Sent Events."""
from __future__ import annotations

import asyncio
import time
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request

from runtime.engine.async_llm import (AsyncLLM, EngineDeadError, EngineRestartingError,
                                      QueueFullError, RequestFailedError, RequestStream)
from runtime.engine.input_processor import PromptType
from runtime.entrypoints.errors import APIError, bad_request
from runtime.entrypoints.reasoning import ReasoningParser
from runtime.entrypoints.structured import check_constraint
from runtime.lora.request import LoRARequest
from runtime.metrics import Metrics
from runtime.multimodal.media import MediaError
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_output.checker import GrammarChecker

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLM
    metrics: Metrics
    model_names: list[str]  # the first is the one reported back
    chat_template: str | None
    api_key: str | None
    log_requests: bool = False
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser, once the engine is up
    # --lora-modules and adapters loaded at run time: name -> adapter, chosen by `model`
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    next_lora_id: int = 1  # for the next adapter loaded at run time
    started: int = field(default_factory=lambda: int(time.time()))  # /v1/models' `created`
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while one loads
    # Tokenization and chat templating run here, off the event loop, so that a large request
    # never stalls the streams or /health. One thread: a fast tokenizer is not safe to share
    # between threads.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    # checks requests' grammars in worker processes (made when the app starts)
    grammars: GrammarChecker | None = None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool,
                                                                partial(fn, *args))


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def grammar_backend(state: ServerState) -> str:
    """The structured-outputs backend the engine compiles grammars with (`--structured-outputs-
    config`), which also checks them when a request arrives."""
    return state.engine.processor.inputs.structured_outputs_backend


def new_id(prefix: str) -> str:
    """The engine's id for an HTTP request: ours and unique (a client's X-Request-Id is only a
    label in the logs and the response headers)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> str:
    """The name to report for a request that asked for `model` (None: the served one); an
    adapter's name is reported as it is. Another name is a 404, as OpenAI and vLLM answer."""
    if model in state.lora_modules:
        return model
    if model is not None and model not in state.model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{state.model_names + list(state.lora_modules)}", param="model",
                       code="model_not_found")
    return state.model_names[0]


def _tokenize(state: ServerState, prompts: list[PromptType]) -> list[dict]:
    """Each prompt's text and token ids, and its images processed (placeholders expanded)."""
    tokenized = []
    for prompt in prompts:
        text, ids, mm_features = state.engine.processor.prepare(prompt)
        tokenized.append({"prompt": text, "prompt_token_ids": ids, "mm_features": mm_features,
                          "prompt_embeds": state.engine.processor.prompt_embeds(prompt)})
    return tokenized


def check_fits(state: ServerState, num_prompts: int, params: SamplingParams) -> None:
    """A 400 for a request that could never be served (a 503 would have it retried forever)."""
    num_seqs = num_prompts * params.num_samples
    if num_seqs > state.engine.max_queue_len:
        param = "prompt" if num_prompts > 1 else "best_of" if params.num_samples > params.n \
            else "n"
        raise bad_request(f"this request needs {num_seqs} sequences ({num_prompts} prompts x "
                          f"{params.num_samples} samples), but at most "
                          f"{state.engine.max_queue_len} may wait (--max-queue-len)", param)


class ClientDisconnected(Exception):
    """The client went away before its reply was ready (the app answers 499, which no one
    reads)."""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(raw: Request | None, work: Awaitable[T]) -> T:
    """Await `work`; if the client `raw` disconnects first, cancel it and raise
    ClientDisconnected."""
    task = asyncio.ensure_future(work)
    if raw is None:
        return await task
    watch = asyncio.ensure_future(_until_disconnected(raw))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def prepared(state: ServerState, params: SamplingParams, constraint_param: str
                   ) -> SamplingParams:
    """`params` with the per-request heavy work done off the event loop: the constraint checked
    by the grammar backend in a worker process, `bad_words` tokenized in the tokenizer
    thread. A 400 naming `constraint_param` when the grammar is refused."""
    if params.structured_outputs is not None:
        await check_constraint(state.grammars, params.structured_outputs, constraint_param)
    if params.bad_words:
        ids = await state.off_loop(state.engine.processor.inputs.bad_words_token_ids,
                                   params.bad_words)
        params = params.clone(_bad_words_token_ids=ids)
    return params


def check_budget(state: ServerState, prompt_token_ids: list[int], max_tokens: int | None,
                 param: str) -> None:
    """As vLLM: the prompt and the requested completion must fit the context together."""
    limit = state.engine.max_model_len
    if max_tokens is not None and len(prompt_token_ids) < limit \
            and len(prompt_token_ids) + max_tokens > limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens, but "
                          f"{len(prompt_token_ids) + max_tokens} were requested "
                          f"({len(prompt_token_ids)} in the prompt, {max_tokens} in the "
                          f"completion): lower {param}", param)


async def open_streams(state: ServerState, request_id: str, prompts: list[PromptType],
                       params: SamplingParams, stream: bool, priority: int = 0,
                       max_tokens_param: str = "max_tokens",
                       model: str | None = None, raw: Request | None = None,
                       constraint_param: str = "structured_outputs") -> list[RequestStream]:
    """Prepare the params (`prepared`) and tokenize, off the event loop, then queue one engine
    request per prompt, all or none: a 400 for bad input or a request that can never fit, a 503
    (with Retry-After) when the waiting queue is full or the engine is restarting, a 500 when
    the engine is dead. The work before queueing stops if the client `raw` disconnects.
    `model` names a LoRA adapter to run under, or the base model; `constraint_param` the
    request field the constraint came from."""
    lora_request = state.lora_modules.get(model) if model is not None else None
    if priority and state.engine.config.scheduling_policy != "priority":
        raise bad_request("priority needs the server started with --scheduling-policy "
                          "priority (it would be ignored)", param="priority")
    check_fits(state, len(prompts), params)
    params = await until_disconnected(raw, prepared(state, params, constraint_param))
    try:
        tokenized = await until_disconnected(raw, state.off_loop(_tokenize, state, prompts))
    except MediaError as e:  # an image that cannot be read: 400, or 413 for its size
        raise APIError(e.status, str(e), param="messages") from None
    except ValueError as e:
        raise bad_request(str(e), param=_param_of(str(e))) from None
    for prompt in tokenized:
        check_budget(state, prompt["prompt_token_ids"], params.max_tokens, max_tokens_param)
    if state.log_requests:
        logger.info("request %s: prompt tokens %s, %s", request_id,
                    [len(p["prompt_token_ids"]) for p in tokenized], params)
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(tokenized):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(state.engine.add_request(sub_id, prompt, params, priority, stream,
                                                    lora_request))
    except BaseException as e:
        for s in streams:
            s.close()
        raise engine_error(state, e) from None
    return streams


def _param_of(message: str) -> str:
    """The request field a processor error is about (its first word when it names one)."""
    first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
    return first if first in ("best_of", "stop_token_ids", "n", "max_tokens", "prompt_embeds",
                              "prompt_logprobs", "kv_transfer_params") else "prompt"


def engine_error(state: ServerState, e: BaseException) -> BaseException:
    """The HTTP error for what `AsyncLLM.add_request` or a stream raised."""
    if isinstance(e, ValueError):
        return bad_request(str(e), param=_param_of(str(e)))
    if isinstance(e, QueueFullError):
        state.metrics.on_request_rejected()
        return APIError(503, f"{e}; retry later", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, EngineRestartingError):
        return APIError(503, f"{e}; retry later", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, (EngineDeadError, RequestFailedError)):
        return APIError(500, str(e))
    return e


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


async def unless_disconnected(request: Request, work: Awaitable[Any],
                              streams: list[RequestStream]) -> Any:
    """Await `work`; if the client disconnects first, cancel it and abort its `streams`."""
    try:
        return await until_disconnected(request, work)
    except ClientDisconnected:
        for s in streams:
            s.close()
        raise


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
    return APIError(500, str(e) or type(e).__name__)
