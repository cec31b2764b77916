"""`AsyncLLM`: the engine for servers. The core steps in its own process; this process tokenizes,
validates, detokenizes and hands each request's outputs to whoever awaits them."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from runtime.config import EngineConfig
from runtime.engine.core_proc import (AddRequests, CoreRequest, CoreStats, Failed,
                                      FinishRequests, FromCore, Outputs, Ready, Shutdown,
                                      run_core_process)
from runtime.engine.input_processor import PromptType
from runtime.engine.output_processor import OutputKind
from runtime.engine.processor import Processor
from runtime.model_loader.source import load_config, resolve_model
from runtime.outputs import RequestMetrics, RequestOutput
from runtime.request import RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class StatsListener(Protocol):
    """Receives what the engine observes (the server's Prometheus metrics implement it)."""

    def on_core_stats(self, stats: CoreStats) -> None: ...

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, num_tokens: int) -> None: ...

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics,
                            tokens_per_sample: float) -> None: ...


class RequestStream:
    """The outputs of one request, in order; ends after the finished output. Leaving the
    iteration early (break, an exception, cancellation) must be followed by `close()`."""

    def __init__(self, engine: "AsyncLLM", request_id: str, num_prompt_tokens: int,
                 n: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.num_output_tokens = 0  # over all samples, as delivered
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    @property
    def tokens_per_sample(self) -> float:
        return self.num_output_tokens / self.n

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    """Call `await start()` in the event loop that will use the engine, then `add_request` and
    iterate over the stream it returns; `await shutdown()` at the end.

    `max_queue_len` bounds the sequences waiting for a place in the running batch (the core's
    waiting queue plus those still on the wire): beyond it `add_request` raises QueueFullError.
    """

    def __init__(self, config: EngineConfig, max_queue_len: int = 1024,
                 listener: StatsListener | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.listener = listener
        self.source = resolve_model(config.model, config.tokenizer)
        self.hf_config = load_config(self.source, config.trust_remote_code)
        self.processor: Processor | None = None
        self.streams: dict[str, RequestStream] = {}
        self.stats = CoreStats(0, 0, 0, 0.0, 0.0, 0)
        self.num_blocks = 0
        self.dead_reason: str | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._num_sent = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._loop_task: asyncio.Task | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._dir: str | None = None

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.inputs.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.process is not None and self.process.is_alive()

    async def start(self) -> None:
        """Spawn the core process and wait until its model is loaded (raises if it fails)."""
        try:
            await self._start()
        except BaseException as e:
            self.dead_reason = str(e) or type(e).__name__
            await self.shutdown()
            raise

    async def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="runtime-core-")
        inbox, outbox = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._zmq = zmq.asyncio.Context()
        self._to_core = zmq.Context.shadow(self._zmq.underlying).socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.bind(inbox)
        self._from_core = self._zmq.socket(zmq.PULL)
        self._from_core.bind(outbox)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_core_process, name="runtime-engine-core",
            args=(self.config, inbox, outbox, logging.getLogger("runtime").getEffectiveLevel()))
        self.process.start()
        logger.info("engine core process %d starting", self.process.pid)
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: died.done() or died.set_result(None))
        receive = asyncio.ensure_future(self._from_core.recv())
        await asyncio.wait([receive, died], return_when=asyncio.FIRST_COMPLETED)
        loop.remove_reader(self.process.sentinel)
        if not receive.done():
            receive.cancel()
            raise EngineDeadError(f"the engine core process exited with code "
                                  f"{self.process.exitcode} while loading the model")
        message = self._decoder.decode(receive.result())
        if isinstance(message, Failed):
            raise EngineDeadError(f"the engine core failed to start: {message.error}")
        assert isinstance(message, Ready)
        self.num_blocks = message.num_blocks
        self.processor = Processor(self.config, self.source, self.hf_config,
                                   message.max_model_len)
        loop.add_reader(self.process.sentinel, self._on_core_exit)
        self._loop_task = asyncio.create_task(self._output_loop())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, stream: bool = False) -> RequestStream:
        """Validate and queue a request; its outputs are deltas if `stream`, else one final
        output. Raises ValueError (bad input), QueueFullError or EngineDeadError."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queued = self.stats.num_waiting + self._num_sent - self.stats.num_received
        if queued + params.n > self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({queued} sequences waiting)")
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        requests = self.processor.add_request(prompt, params, request_id, priority, kind)
        handle = RequestStream(self, request_id, requests[0].num_prompt_tokens, params.n)
        self.streams[request_id] = handle
        self._send(AddRequests([CoreRequest.of(r) for r in requests]))
        self._num_sent += len(requests)
        if self.listener is not None:
            self.listener.on_request_added(handle.num_prompt_tokens)
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks in the core (a no-op once it has finished)."""
        handle = self.streams.pop(request_id, None)
        sample_ids, output = self.processor.abort_request(request_id)
        if sample_ids and self.dead_reason is None:
            self._send(FinishRequests(sample_ids, RequestStatus.FINISHED_ABORTED,
                                      [None] * len(sample_ids)))
        if output is not None and self.listener is not None and handle is not None:
            self.listener.on_request_finished("abort", output.metrics, handle.tokens_per_sample)

    async def shutdown(self) -> None:
        """Abort what is still running, stop the core process and release the sockets."""
        for request_id in list(self.streams):
            self.streams[request_id].put(EngineDeadError("the server is shutting down"))
            self.abort(request_id)
        if self.process is not None and self.process.is_alive():
            if self.dead_reason is None:
                self._send(Shutdown())
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
            await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
            if self.process.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it",
                               SHUTDOWN_TIMEOUT_S)
                self.process.kill()
                await asyncio.to_thread(self.process.join)
        self.dead_reason = self.dead_reason or "the engine has shut down"
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._zmq is not None:
            self._to_core.close(linger=0)
            self._zmq.destroy(linger=0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, message: AddRequests | FinishRequests | Shutdown) -> None:
        try:
            self._to_core.send(self._encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:  # no core on the other end: its exit fails the requests
            logger.warning("the engine core is not reachable; %s dropped",
                           type(message).__name__)

    async def _output_loop(self) -> None:
        while True:
            message = self._decoder.decode(await self._from_core.recv())
            if isinstance(message, Failed):
                self._fail(f"the engine core failed: {message.error}")
            elif isinstance(message, Outputs):
                try:
                    self._handle(message)
                except Exception as e:  # a bug here must fail requests, not hang them
                    logger.exception("output processing failed")
                    self._fail(f"output processing failed: {e}")

    def _handle(self, message: Outputs) -> None:
        self.stats = message.stats
        results, stopped = self.processor.process_outputs(message.outputs)
        if stopped:
            self._send(FinishRequests([s for s, _ in stopped], RequestStatus.FINISHED_STOPPED,
                                      [stop for _, stop in stopped]))
        listener = self.listener
        if listener is not None:
            listener.on_core_stats(message.stats)
            listener.on_tokens(sum(len(o.new_token_ids) for o in message.outputs))
        for output in results:
            handle = self.streams.get(output.request_id)
            if handle is None:
                continue
            handle.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
            handle.put(output)
            if output.finished:
                del self.streams[output.request_id]
                if listener is not None:
                    listener.on_request_finished(output.outputs[-1].finish_reason,
                                                 output.metrics, handle.tokens_per_sample)

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(1)  # reap it, for its exit code
        self._fail(f"the engine core process exited with code {self.process.exitcode}")

    def _fail(self, reason: str) -> None:
        """The core is unusable: fail every request now and every request from now on."""
        if self.dead_reason is None:
            logger.error("%s; failing %d requests", reason, len(self.streams))
            self.dead_reason = reason
        for request_id, handle in list(self.streams.items()):
            handle.put(EngineDeadError(reason))
            del self.streams[request_id]
            self.processor.abort_request(request_id)
