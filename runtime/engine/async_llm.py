"""`AsyncLLM`: the engine for servers. The cores step in their own processes (a ReplicaPool,
one per data-parallel replica, supervised and restarted there); this process tokenizes,
validates, detokenizes and hands each request's outputs to whoever awaits them.

It also keeps what each request in flight was admitted with (its core requests) and, in the
output processor, the tokens each sample has generated, so that when a core dies its requests
are re-admitted on a live one with their tokens so far and their streams go on: the sampler's
seeded generators depend only on the seed and the output position (runtime.sampling.generators),
so greedy and seeded requests end with the tokens of an undisturbed run. A request in flight at
two deaths in a row is the likely culprit: alone, it fails; with others, those run one at a
time (isolated), and the one running when a core dies again fails."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from typing import Any, Protocol

import msgspec
import torch

from runtime.config import EngineConfig
from runtime.engine.core_client import EngineDeadError
from runtime.engine.core import EngineBusyError
from runtime.engine.core_proc import (AddRequests, Control, CoreRequest, CoreStats,
                                      FinishRequests, FromCore, Outputs, Ready, RequestsFailed,
                                      Sleep, UpdateWeights, WakeUp)
from runtime.engine.input_processor import PromptType
from runtime.engine.output_processor import OutputKind
from runtime.engine.pooling_engine import by_length, pooling_config, pooling_request
from runtime.engine.processor import Processor
from runtime.engine.replica_pool import EngineRestartingError, QueueFullError, ReplicaPool
from runtime.lora.request import LoRARequest
from runtime.model_spec import ModelSpec
from runtime.outputs import RequestMetrics, RequestOutput
from runtime.pooling.processor import PoolingInput, PoolingProcessor
from runtime.request import RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineBusyError", "EngineDeadError", "EngineRestartingError",
           "EngineSleepingError", "QueueFullError", "RequestFailedError", "RequestStream"]


class RequestFailedError(RuntimeError):
    """The core raised on this request (or its core died under it); other requests go on."""


class EngineSleepingError(EngineRestartingError):
    """The engine is asleep (sleep mode), or going to sleep, waking up or loading weights:
    nothing runs until it is awake again."""


class StatsListener(Protocol):
    """Receives what the engine observes (the server's Prometheus metrics implement it)."""

    def on_core_stats(self, stats: CoreStats) -> None: ...

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, num_tokens: int) -> None: ...

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics,
                            tokens_per_sample: float) -> None: ...

    def on_core_restart(self) -> None: ...

    def on_sleep_state(self, asleep: set[str]) -> None:
        """What sleep mode has freed now ("weights", "kv_cache"; empty: awake)."""


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

    `max_queue_len` bounds the sequences waiting for a place in the running batch (the cores'
    waiting queues plus those still on the wire): beyond it `add_request` raises QueueFullError.

    With `data_parallel_size` N > 1 the pool runs N core processes, each a whole engine (with
    its own tensor/pipeline-parallel workers), and routes each request to one.

    A pooling model (`runner`, or auto-detected) serves `encode` instead of `add_request`: its
    requests go through the same cores, batched together by their schedulers; `pooling` (the
    model's PoolingProcessor, set by `start`) prepares them and shapes their results.
    """

    def __init__(self, config: EngineConfig, max_queue_len: int = 1024,
                 listener: StatsListener | None = None, max_core_restarts: int = 2) -> None:
        self.spec = ModelSpec.resolve(config)
        self.config = pooling_config(config) if self.spec.pools else config
        self.max_queue_len = max_queue_len
        self.listener = listener
        self.source = self.spec.source
        self.hf_config = self.spec.hf_config
        self.processor: Processor | None = None
        self.pooling: PoolingProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        self.pooled: dict[str, asyncio.Future] = {}  # pooling request id -> its result
        # what each request in flight was admitted with, to re-admit it if its core dies
        self.admitted: dict[str, list[CoreRequest]] = {}
        self.deaths: dict[str, int] = {}  # request id -> core deaths it was in flight for
        self.orphans: dict[str, None] = {}  # lost with their core, waiting for a live one
        self.suspects: deque[str] = deque()  # in flight at two deaths, waiting to run alone
        self.isolated: str | None = None  # the suspect now running
        self.num_blocks = 0
        self.cores = ReplicaPool(self.config, self.spec, self, max_core_restarts)
        self.asleep: set[str] = set()  # what sleep freed, on any replica
        self.weights_path = self.source.path  # the checkpoint whose weights are served
        self._control_lock = asyncio.Lock()  # held while a sleep-mode or weight call runs

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.inputs.max_model_len

    @property
    def stats(self) -> CoreStats:
        return self.cores.stats

    @property
    def dead_reason(self) -> str | None:
        """Why no request can be served now: dead for good, or restarting (None: serving)."""
        return self.cores.down_reason

    @property
    def is_healthy(self) -> bool:
        return self.cores.is_alive

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    async def start(self) -> None:
        """Spawn the core processes and wait until their models are loaded (raises if one
        fails)."""
        readies = await self.cores.start()
        self.num_blocks = min(r.num_blocks for r in readies)
        max_model_len = min(r.max_model_len for r in readies)
        self.processor = Processor(self.config, self.source, self.hf_config, max_model_len)
        if self.spec.pools:
            self.pooling = PoolingProcessor(self.config, self.source, self.hf_config,
                                            max_model_len)

    async def wait_fatal(self) -> str:
        """Return once the engine is dead for good (a core kept dying); returns why."""
        return await self.cores.wait_fatal()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, stream: bool = False,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue a request; its outputs are deltas if `stream`, else one final
        output. Raises ValueError (bad input), QueueFullError, EngineRestartingError or
        EngineDeadError."""
        self._check_awake()
        self.cores.check_admission(params.num_samples, self.max_queue_len)
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        requests = self.processor.add_request(prompt, params, request_id, priority, kind,
                                              lora_request)
        handle = RequestStream(self, request_id, requests[0].num_prompt_tokens, params.n)
        self.streams[request_id] = handle
        self._admit(request_id, [CoreRequest.of(r) for r in requests])
        if self.listener is not None:
            self.listener.on_request_added(handle.num_prompt_tokens)
        return handle

    async def encode(self, inputs: list[PoolingInput], priority: int = 0) -> list[torch.Tensor]:
        """Pool `inputs` (from `self.pooling`): each is a request of the cores, scheduled with
        whatever else they run; returns their results in order. Raises as `add_request` does,
        or the error of a request that failed; leaving early aborts those still running."""
        self._check_awake()
        self.cores.check_admission(len(inputs), self.max_queue_len)
        loop, arrival = asyncio.get_running_loop(), time.monotonic()
        batches = defaultdict(list)
        for item in by_length(inputs):
            replica = self.cores.route(item.request_id, item.prompt_token_ids, 1)
            self.pooled[item.request_id] = loop.create_future()
            request = CoreRequest.of(pooling_request(item, priority))
            self.admitted[item.request_id] = [request]
            batches[replica].append(request)
        futures = [self.pooled[item.request_id] for item in inputs]
        for replica, requests in batches.items():
            self.cores.add(replica, AddRequests(requests))
        if self.listener is not None:
            for item in inputs:
                self.listener.on_request_added(len(item.prompt_token_ids))
        try:
            results = list(await asyncio.gather(*futures))
            if self.listener is not None:
                metrics = RequestMetrics(arrival_time=arrival, finished_time=time.monotonic())
                for _ in inputs:
                    self.listener.on_request_finished("stop", metrics, 0)
            return results
        finally:
            for item in inputs:
                if item.request_id in self.pooled:
                    self.abort(item.request_id)

    def _check_awake(self) -> None:
        if self._control_lock.locked():
            raise EngineSleepingError("the engine is going to sleep, waking up or loading "
                                      "weights")
        if self.asleep:
            raise EngineSleepingError("the engine is asleep (sleep mode) until woken up")

    async def sleep(self, level: int = 1) -> None:
        """Free every replica's KV cache (level 1), and the weights too (level 2); until
        `wake_up` new requests get EngineSleepingError. Raises EngineBusyError while requests
        are in flight (they are not waited for), ValueError on bad input."""
        await self._control(Sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` ("weights", "kv_cache"; None: both) name on every replica."""
        await self._control(WakeUp(tags))

    async def update_weights(self, model_path: str) -> None:
        """Serve the weights of `model_path` (same architecture and config) on every replica;
        raises as `sleep` does. A replica that cannot load them keeps the old weights, and
        the others go back to them, so all replicas serve one checkpoint."""
        await self._control(UpdateWeights(model_path), rollback=True)
        self.weights_path = model_path

    async def _control(self, message: Control, rollback: bool = False) -> None:
        """Send `message` to every replica; raises the first refusal (after putting the
        replicas that took new weights back on the old ones, with `rollback`)."""
        async with self._control_lock:
            busy = len(self.streams) + len(self.pooled)
            if busy:
                raise EngineBusyError(f"{busy} requests are in flight: let them finish or "
                                      "abort them first (POST /abort_requests)")
            answers = await self.cores.control(message)
            self.asleep = set().union(*(a.asleep for a in answers.values()))
            if self.listener is not None:
                self.listener.on_sleep_state(self.asleep)
            refused = [a for a in answers.values() if a.error is not None]
            if not refused:
                return
            took = [i for i, a in answers.items() if a.error is None]
            if rollback and took:
                await self.cores.control(UpdateWeights(self.weights_path), took)
            error = refused[0]
            raise (EngineBusyError if error.error_type == "EngineBusyError" else
                   ValueError)(error.error)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks in the core (a no-op once it has finished)."""
        handle = self.streams.pop(request_id, None)
        self._forget(request_id)
        sample_ids, output = self.processor.abort_request(request_id)
        if handle is not None and output is not None:  # a caller still iterating ends here
            handle.put(output)
        if self.pooled.pop(request_id, None) is not None:
            sample_ids = [request_id]
        self.cores.finish(request_id, FinishRequests(
            sample_ids, RequestStatus.FINISHED_ABORTED, [None] * len(sample_ids))
            if sample_ids else None)
        if output is not None and self.listener is not None and handle is not None:
            self.listener.on_request_finished("abort", output.metrics, handle.tokens_per_sample)

    def fail_all(self, reason: str) -> None:
        """End every request in flight with an error (their streams send the error event)."""
        for request_id in [*self.streams, *self.pooled]:
            self.on_request_failed(request_id, EngineDeadError(reason))

    async def shutdown(self) -> None:
        """Abort what is still running, stop the core processes and release the sockets."""
        self.fail_all("the server is shutting down")
        await self.cores.shutdown()

    def on_message(self, replica: int, message: FromCore) -> None:
        if isinstance(message, RequestsFailed):
            for request_id in message.request_ids:
                self.on_request_failed(request_id, RequestFailedError(
                    f"the engine failed on this request: {message.error}"))
        elif isinstance(message, Outputs):
            self.on_outputs(replica, message)

    def on_outputs(self, replica: int, message: Outputs) -> None:
        for out in message.outputs:
            future = self.pooled.pop(out.request_id, None) if out.pooling_output is not None \
                else None
            if future is not None:
                future.set_result(out.pooling_output.tensor())
                self.cores.release(out.request_id)
                self._forget(out.request_id)
        results, stopped = self.processor.process_outputs(message.outputs)
        if stopped:
            self.cores.send(replica, FinishRequests(
                [s for s, _ in stopped], RequestStatus.FINISHED_STOPPED,
                [stop for _, stop in stopped]))
        listener = self.listener
        if listener is not None:
            listener.on_core_stats(self.stats)
            listener.on_tokens(sum(len(o.new_token_ids) for o in message.outputs))
        for output in results:
            handle = self.streams.get(output.request_id)
            if handle is None:
                continue
            handle.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
            handle.put(output)
            if output.finished:
                del self.streams[output.request_id]
                self.cores.release(output.request_id)
                self._forget(output.request_id)
                if listener is not None:
                    listener.on_request_finished(output.outputs[-1].finish_reason,
                                                 output.metrics, handle.tokens_per_sample)

    def on_request_failed(self, request_id: str, error: Exception) -> None:
        """End one request with `error` and abort whatever the core still runs of it."""
        handle = self.streams.get(request_id)
        if handle is not None:
            handle.put(error)
        future = self.pooled.get(request_id)
        if future is not None and not future.done():
            future.set_exception(error)
        self.abort(request_id)

    def on_requests_lost(self, request_ids: list[str], reason: str) -> None:
        """A core died under these requests: re-admit them on a live core (now, or when the
        restarted one is up), failing the one that killed cores twice in a row."""
        if self.isolated in request_ids:  # it ran alone among the suspects: the culprit
            culprits, self.isolated = [self.isolated], None
        else:
            for request_id in request_ids:
                self.deaths[request_id] = self.deaths.get(request_id, 0) + 1
            culprits = [r for r in request_ids if self.deaths[r] >= 2]
            if len(culprits) > 1:
                logger.warning("%d requests were in flight at two core deaths in a row: they "
                               "run one at a time to find the one to blame", len(culprits))
                self.suspects.extend(reversed(culprits))  # the newest first
                culprits = []
        for request_id in culprits:
            self.on_request_failed(request_id, RequestFailedError(
                f"the engine core died twice in a row while running this request ({reason})"))
        for request_id in request_ids:
            if request_id in self.admitted and request_id not in self.suspects:
                self.orphans[request_id] = None
        self._readmit()

    def on_engine_dead(self, reason: str) -> None:
        self.orphans.clear()
        self.suspects.clear()
        self.fail_all(reason)

    def on_replica_restarted(self, ready: Ready) -> None:
        self.processor.inputs.max_model_len = min(self.max_model_len, ready.max_model_len)
        if self.listener is not None:
            self.listener.on_core_restart()
        self._readmit()

    def _admit(self, request_id: str, requests: list[CoreRequest]) -> None:
        self.admitted[request_id] = requests
        replica = self.cores.route(request_id, requests[0].prompt_token_ids, len(requests))
        self.cores.add(replica, AddRequests(requests))

    def _readmit(self) -> None:
        """Send the lost requests to a live core, each with the tokens it has so far, and the
        next suspect if none runs."""
        if not self.cores.is_alive:
            return
        orphans, self.orphans = list(self.orphans), {}
        for request_id in orphans:
            self._resume(request_id)
        while self.isolated is None and self.suspects:
            self.isolated = self.suspects.popleft()
            self._resume(self.isolated)

    def _resume(self, request_id: str) -> None:
        requests = self.admitted.get(request_id)
        if requests is None:  # it ended meanwhile
            return
        state = self.processor.outputs.requests.get(request_id)
        if state is not None:  # generating: each unfinished sample goes on from its tokens
            requests = [msgspec.structs.replace(
                r, output_token_ids=list(state.samples[r.request_id].token_ids))
                for r in requests if state.samples[r.request_id].finish_reason is None]
        logger.info("request %s re-admitted%s", request_id, "" if state is None else
                    f" with {sum(len(r.output_token_ids) for r in requests)} tokens generated")
        replica = self.cores.route(request_id, requests[0].prompt_token_ids, len(requests))
        self.cores.add(replica, AddRequests(requests))

    def _forget(self, request_id: str) -> None:
        """A request ended: drop what re-admitting it would need."""
        self.admitted.pop(request_id, None)
        self.deaths.pop(request_id, None)
        self.orphans.pop(request_id, None)
        if request_id in self.suspects:
            self.suspects.remove(request_id)
        if self.isolated == request_id:
            self.isolated = None
            self._readmit()
