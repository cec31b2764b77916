"""`AsyncLLM`: the engine for servers. The core steps in its own process (one per data-parallel
replica); this process tokenizes, validates, routes each request to a replica, detokenizes and
hands each request's outputs to whoever awaits them.

The cores are supervised: one that dies fails its in-flight requests at once and is started
again with the same configuration, after a backoff; one that dies `max_core_restarts` + 1 times
within `RESTART_WINDOW_S` stays dead, and `wait_fatal()` returns so that the server can exit."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any, Protocol

import torch

from runtime.config import EngineConfig
from runtime.distributed.load_balancer import LoadBalancer
from runtime.engine.core_client import CoreClient, EngineDeadError
from runtime.engine.core_proc import (AddRequests, CoreRequest, CoreStats, Failed,
                                      FinishRequests, Outputs, Ready, RequestsFailed)
from runtime.engine.input_processor import PromptType
from runtime.engine.output_processor import OutputKind
from runtime.engine.pooling_engine import by_length, pooling_config, pooling_request
from runtime.engine.processor import Processor
from runtime.lora.request import LoRARequest
from runtime.model_loader.source import load_config, resolve_model
from runtime.outputs import RequestMetrics, RequestOutput
from runtime.pooling.models import resolve_runner
from runtime.pooling.processor import PoolingInput, PoolingProcessor
from runtime.request import RequestStatus
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineRestartingError", "QueueFullError",
           "RequestFailedError", "RequestStream"]

RESTART_WINDOW_S = 60.0  # deaths further apart than this do not add up
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the first, second, ... restart in a window


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineRestartingError(RuntimeError):
    """No core is up right now, but one is being restarted; the caller should retry later."""


class RequestFailedError(RuntimeError):
    """The core raised on this request (or its core died under it); other requests go on."""


class StatsListener(Protocol):
    """Receives what the engine observes (the server's Prometheus metrics implement it)."""

    def on_core_stats(self, stats: CoreStats) -> None: ...

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, num_tokens: int) -> None: ...

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics,
                            tokens_per_sample: float) -> None: ...

    def on_core_restart(self) -> None: ...


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

    With `data_parallel_size` N > 1 there are N core processes, each a whole engine (with its
    own tensor/pipeline-parallel workers); a LoadBalancer picks one per request. A replica that
    dies fails its own requests and leaves the rotation until its restart is up.

    A pooling model (`runner`, or auto-detected) serves `encode` instead of `add_request`: its
    requests go through the same cores, batched together by their schedulers; `pooling` (the
    model's PoolingProcessor, set by `start`) prepares them and shapes their results.
    """

    def __init__(self, config: EngineConfig, max_queue_len: int = 1024,
                 listener: StatsListener | None = None, max_core_restarts: int = 2) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.listener = listener
        self.max_core_restarts = max_core_restarts
        self.source = resolve_model(config.model, config.tokenizer)
        self.hf_config = load_config(self.source, config.trust_remote_code)
        pools = resolve_runner(config.runner, self.source, self.hf_config) == "pooling"
        if pools:
            config = pooling_config(config)
        self.processor: Processor | None = None
        self.pooling: PoolingProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        self.pooled: dict[str, asyncio.Future] = {}  # pooling request id -> its result
        self.stats = CoreStats(0, 0, 0, 0.0, 0.0, 0)
        self.num_blocks = 0
        self.dead_reason: str | None = None
        n = config.data_parallel_size
        self._pools = pools
        self._replica_config = dataclasses.replace(config, data_parallel_size=1,
                                                   data_parallel_size_local=n)
        self.replicas = [self._client(i) for i in range(n)]
        self.balancer = LoadBalancer(n, config.block_size, config.enable_prefix_caching)
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its sequences)
        self._replica_stats = [self.stats] * n
        self._num_sent = [0] * n
        self._output_tasks: list[asyncio.Task | None] = [None] * n
        self._restarts: set[asyncio.Task] = set()
        self._deaths: list[list[float]] = [[] for _ in range(n)]  # monotonic times, per replica
        self._fatal: asyncio.Event | None = None

    def _client(self, replica: int) -> CoreClient:
        name = "the engine core" if self.config.data_parallel_size == 1 \
            else f"data-parallel replica {replica}"
        config = dataclasses.replace(self._replica_config, data_parallel_rank=replica)
        return CoreClient(config, name)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.inputs.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and any(r.is_alive for r in self.replicas)

    async def start(self) -> None:
        """Spawn the core processes and wait until their models are loaded (raises if one
        fails)."""
        self._fatal = asyncio.Event()
        results = await asyncio.gather(*(r.start() for r in self.replicas),
                                       return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:
            self.dead_reason = str(failed) or type(failed).__name__
            await self.shutdown()
            raise failed
        readies = results
        self.num_blocks = min(r.num_blocks for r in readies)
        max_model_len = min(r.max_model_len for r in readies)
        self.processor = Processor(self.config, self.source, self.hf_config, max_model_len)
        if self._pools:
            self.pooling = PoolingProcessor(self.config, self.source, self.hf_config,
                                            max_model_len)
        for i in range(len(self.replicas)):
            self._watch(i)

    def _watch(self, replica: int) -> None:
        """Follow a started core: its outputs, and its exit."""
        client = self.replicas[replica]
        asyncio.get_running_loop().add_reader(client.process.sentinel, self._on_core_exit,
                                              replica)
        self._output_tasks[replica] = asyncio.create_task(self._output_loop(replica))

    async def wait_fatal(self) -> str:
        """Return once the engine is dead for good (a core kept dying); returns why."""
        await self._fatal.wait()
        return self.dead_reason

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, stream: bool = False,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue a request; its outputs are deltas if `stream`, else one final
        output. Raises ValueError (bad input), QueueFullError, EngineRestartingError or
        EngineDeadError."""
        self._check_admission(params.num_samples)
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        requests = self.processor.add_request(prompt, params, request_id, priority, kind,
                                              lora_request)
        replica = self.balancer.choose(requests[0].prompt_token_ids)
        handle = RequestStream(self, request_id, requests[0].num_prompt_tokens, params.n)
        self.streams[request_id] = handle
        self.owner[request_id] = (replica, len(requests))
        self.balancer.started(replica, len(requests))
        self.replicas[replica].send(AddRequests([CoreRequest.of(r) for r in requests]))
        self._num_sent[replica] += len(requests)
        if self.listener is not None:
            self.listener.on_request_added(handle.num_prompt_tokens)
        return handle

    def _check_admission(self, num_seqs: int) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not any(r.is_alive for r in self.replicas):
            raise EngineRestartingError("the engine core is restarting")
        queued = sum(s.num_waiting + sent - s.num_received
                     for s, sent, r in zip(self._replica_stats, self._num_sent, self.replicas)
                     if r.dead_reason is None)
        if queued + num_seqs > self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({queued} sequences waiting)")

    async def encode(self, inputs: list[PoolingInput], priority: int = 0) -> list[torch.Tensor]:
        """Pool `inputs` (from `self.pooling`): each is a request of the cores, scheduled with
        whatever else they run; returns their results in order. Raises as `add_request` does,
        or the error of a request that failed; leaving early aborts those still running."""
        self._check_admission(len(inputs))
        loop, arrival = asyncio.get_running_loop(), time.monotonic()
        batches = defaultdict(list)
        for item in by_length(inputs):
            replica = self.balancer.choose(item.prompt_token_ids)
            self.balancer.started(replica, 1)
            self.owner[item.request_id] = (replica, 1)
            self.pooled[item.request_id] = loop.create_future()
            batches[replica].append(CoreRequest.of(pooling_request(item, priority)))
        futures = [self.pooled[item.request_id] for item in inputs]
        for replica, requests in batches.items():
            self.replicas[replica].send(AddRequests(requests))
            self._num_sent[replica] += len(requests)
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

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks in the core (a no-op once it has finished)."""
        handle = self.streams.pop(request_id, None)
        sample_ids, output = self.processor.abort_request(request_id)
        if self.pooled.pop(request_id, None) is not None:
            sample_ids = [request_id]
        replica = self._release(request_id)
        if sample_ids and replica is not None and self.replicas[replica].dead_reason is None:
            self.replicas[replica].send(FinishRequests(
                sample_ids, RequestStatus.FINISHED_ABORTED, [None] * len(sample_ids)))
        if output is not None and self.listener is not None and handle is not None:
            self.listener.on_request_finished("abort", output.metrics, handle.tokens_per_sample)

    def fail_all(self, reason: str) -> None:
        """End every request in flight with an error (their streams send the error event)."""
        for request_id in [*self.streams, *self.pooled]:
            self._fail_request(request_id, EngineDeadError(reason))

    async def shutdown(self) -> None:
        """Abort what is still running, stop the core processes and release the sockets."""
        self.fail_all("the server is shutting down")
        self.dead_reason = self.dead_reason or "the engine has shut down"
        for task in self._restarts:
            task.cancel()
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            if replica.process is not None:
                loop.remove_reader(replica.process.sentinel)
        for task in self._output_tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas))

    def _release(self, request_id: str) -> int | None:
        """Forget which replica serves a request; returns that replica."""
        owner = self.owner.pop(request_id, None)
        if owner is None:
            return None
        self.balancer.finished(*owner)
        return owner[0]

    async def _output_loop(self, replica: int) -> None:
        client = self.replicas[replica]
        while True:
            message = await client.recv()
            if isinstance(message, Failed):
                self._replica_died(replica, f"{client.name} failed: {message.error}")
                return
            try:
                if isinstance(message, RequestsFailed):
                    for request_id in message.request_ids:
                        self._fail_request(request_id, RequestFailedError(
                            f"the engine failed on this request: {message.error}"))
                elif isinstance(message, Outputs):
                    self._handle(replica, message)
            except Exception as e:  # a bug here must fail requests, not hang them
                logger.exception("output processing failed")
                self._replica_died(replica, f"output processing failed: {e}")
                return

    def _handle(self, replica: int, message: Outputs) -> None:
        self._replica_stats[replica] = message.stats
        self.stats = self._total_stats()
        for out in message.outputs:
            future = self.pooled.pop(out.request_id, None) if out.pooling_output is not None \
                else None
            if future is not None:
                future.set_result(out.pooling_output.tensor())
                self._release(out.request_id)
        results, stopped = self.processor.process_outputs(message.outputs)
        if stopped:
            self.replicas[replica].send(FinishRequests(
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
                self._release(output.request_id)
                if listener is not None:
                    listener.on_request_finished(output.outputs[-1].finish_reason,
                                                 output.metrics, handle.tokens_per_sample)

    def _total_stats(self) -> CoreStats:
        """The live replicas' stats together (usage and hit rate as their mean)."""
        live = [s for s, r in zip(self._replica_stats, self.replicas) if r.dead_reason is None]
        if not live:
            return self.stats
        k = len(live)
        return CoreStats(sum(s.num_running for s in live), sum(s.num_waiting for s in live),
                         sum(s.num_received for s in live),
                         sum(s.kv_cache_usage for s in live) / k,
                         sum(s.prefix_cache_hit_rate for s in live) / k,
                         sum(s.num_preemptions for s in live),
                         sum(s.num_spec_drafts for s in live),
                         sum(s.num_spec_draft_tokens for s in live),
                         sum(s.num_spec_accepted_tokens for s in live),
                         sum(s.num_grammar_compiles for s in live),
                         sum(s.grammar_compile_seconds for s in live),
                         sum(s.num_grammar_cache_hits for s in live),
                         sum(s.num_grammar_cache_misses for s in live),
                         [sum(c) for c in zip(*(s.grammar_compile_counts for s in live
                                                if s.grammar_compile_counts))],
                         sum(s.num_prefix_cache_queries for s in live),
                         sum(s.num_prefix_cache_hits for s in live),
                         [sum(c) for c in zip(*(s.step_token_counts for s in live
                                                if s.step_token_counts))],
                         sum(s.num_step_tokens for s in live),
                         sorted({a for s in live for a in s.running_lora_adapters}),
                         sorted({a for s in live for a in s.waiting_lora_adapters}))

    def _on_core_exit(self, replica: int) -> None:
        client = self.replicas[replica]
        asyncio.get_running_loop().remove_reader(client.process.sentinel)
        self._replica_died(replica, client.exit_reason())

    def _replica_died(self, replica: int, reason: str) -> None:
        """Fail the replica's requests now, take it out of rotation and restart it (or, when
        it keeps dying, give up: the engine is dead)."""
        client = self.replicas[replica]
        if client.dead_reason is not None:
            return
        client.dead_reason = reason
        loop = asyncio.get_running_loop()
        if client.process is not None:
            loop.remove_reader(client.process.sentinel)
        task = self._output_tasks[replica]
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self.balancer.remove(replica)
        self.stats = self._total_stats()
        logger.error("%s; failing its %d requests", reason,
                     sum(owner == replica for owner, _ in self.owner.values()))
        for request_id, (owner, _) in list(self.owner.items()):
            if owner == replica:
                self._fail_request(request_id, EngineDeadError(reason))
        now = time.monotonic()
        deaths = [t for t in self._deaths[replica] if now - t < RESTART_WINDOW_S] + [now]
        self._deaths[replica] = deaths
        if self.dead_reason is not None:
            return
        if len(deaths) > self.max_core_restarts:
            self.dead_reason = (f"{reason}; it died {len(deaths)} times within "
                                f"{RESTART_WINDOW_S:.0f} s, so it is not restarted again")
            logger.error("%s", self.dead_reason)
            self.fail_all(self.dead_reason)
            self._fatal.set()
            return
        task = asyncio.create_task(self._restart(replica, len(deaths)))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, replica: int, attempt: int) -> None:
        """Start a fresh core for `replica` with the same configuration, after a backoff."""
        delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S)) - 1]
        logger.warning("restarting %s in %.0f s (restart %d of at most %d within %.0f s)",
                       self.replicas[replica].name, delay, attempt, self.max_core_restarts,
                       RESTART_WINDOW_S)
        await asyncio.sleep(delay)
        await self.replicas[replica].shutdown()
        client = self._client(replica)
        self.replicas[replica] = client
        try:
            ready: Ready = await client.start()
        except Exception as e:
            self._replica_died(replica, str(e))
            return
        if self.dead_reason is not None:
            return await client.shutdown()
        self.processor.inputs.max_model_len = min(self.max_model_len, ready.max_model_len)
        self._replica_stats[replica] = CoreStats(0, 0, 0, 0.0, 0.0, 0)
        self._num_sent[replica] = 0
        self.balancer.alive[replica] = True  # back in rotation, with nothing routed to it
        self._watch(replica)
        logger.warning("%s is serving again", client.name)
        if self.listener is not None:
            self.listener.on_core_restart()

    def _fail_request(self, request_id: str, error: Exception) -> None:
        """End one request with `error` and abort whatever the core still runs of it."""
        handle = self.streams.get(request_id)
        if handle is not None:
            handle.put(error)
        future = self.pooled.get(request_id)
        if future is not None and not future.done():
            future.set_exception(error)
        self.abort(request_id)
