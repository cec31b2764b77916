"""The engine-core processes behind `AsyncLLM`: one per data-parallel replica, each request
routed to one of them, each supervised.

A core that dies (or, with `engine_stall_timeout`, stops stepping while it has requests: it is
killed) hands its in-flight requests back to the owner, which re-admits them on a live core,
and is started again with the same configuration, after a backoff; one that dies
`max_core_restarts` + 1 times within `RESTART_WINDOW_S` stays dead, the whole pool is dead, and
`wait_fatal()` returns so that the server can exit. A dead replica leaves the rotation until
its restart is up."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Protocol, Sequence

from runtime.config import EngineConfig
from runtime.engine.core_client import CoreClient, EngineDeadError
from runtime.engine.core_proc import (AddRequests, Control, Controlled, CoreStats, Failed,
                                      FinishRequests, FromCore, Outputs, Ready)
from runtime.engine.load_balancer import LoadBalancer
from runtime.model_spec import ModelSpec

logger = logging.getLogger(__name__)

RESTART_WINDOW_S = 60.0  # deaths further apart than this do not add up
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the first, second, ... restart in a window


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineRestartingError(RuntimeError):
    """No core is up right now, but one is being restarted; the caller should retry later."""


class ReplicaEvents(Protocol):
    """What the pool tells its owner (`AsyncLLM`)."""

    def on_message(self, replica: int, message: FromCore) -> None:
        """A core's message other than `Failed` (which the pool handles)."""

    def on_requests_lost(self, request_ids: list[str], reason: str) -> None:
        """The requests (released here) of a replica that died, which will be restarted."""

    def on_engine_dead(self, reason: str) -> None:
        """The pool is dead for good: every request in flight must end."""

    def on_replica_restarted(self, ready: Ready) -> None: ...


class ReplicaPool:
    def __init__(self, config: EngineConfig, spec: ModelSpec, events: ReplicaEvents,
                 max_core_restarts: int = 2) -> None:
        n = config.data_parallel_size
        self.config = dataclasses.replace(config, data_parallel_size=1,
                                          data_parallel_size_local=n)
        self.spec = spec
        self.events = events
        self.max_core_restarts = max_core_restarts
        self.replicas = [self._client(i) for i in range(n)]
        self.balancer = LoadBalancer(n, config.block_size, config.enable_prefix_caching)
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its sequences)
        self.stats = CoreStats()  # the live replicas' together
        self.dead_reason: str | None = None
        self._replica_stats = [CoreStats() for _ in range(n)]
        self._num_sent = [0] * n
        self._output_tasks: list[asyncio.Task | None] = [None] * n
        self._restarts: set[asyncio.Task] = set()
        self._deaths: list[list[float]] = [[] for _ in range(n)]  # monotonic times, per replica
        self._fatal: asyncio.Event | None = None
        # the stall watchdog: when each replica last said something, or was given work idle
        self._last_heard = [0.0] * n
        self._watchdog: asyncio.Task | None = None
        self._death_reasons: list[str | None] = [None] * n  # of the replicas restarting
        # per replica: the futures of its Control messages not answered yet, oldest first
        self._controls: list[deque[asyncio.Future]] = [deque() for _ in range(n)]

    def _client(self, replica: int) -> CoreClient:
        name = "the engine core" if self.config.data_parallel_size_local == 1 \
            else f"data-parallel replica {replica}"
        return CoreClient(dataclasses.replace(self.config, data_parallel_rank=replica),
                          self.spec, name)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and any(r.is_alive for r in self.replicas)

    @property
    def down_reason(self) -> str | None:
        """Why no request can be served now (None: some core serves)."""
        if self.dead_reason is not None or self.is_alive:
            return self.dead_reason
        down = [reason for reason in self._death_reasons if reason is not None]
        return f"the engine core is restarting ({down[0]})" if down else \
            "the engine core is restarting"

    async def start(self) -> list[Ready]:
        """Spawn the core processes and wait until their models are loaded (raises, having
        stopped them all, if one fails)."""
        self._fatal = asyncio.Event()
        results = await asyncio.gather(*(r.start() for r in self.replicas),
                                       return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:
            self.dead_reason = str(failed) or type(failed).__name__
            await self.shutdown()
            raise failed
        for i in range(len(self.replicas)):
            self._watch(i)
        if self.config.engine_stall_timeout > 0:
            self._watchdog = asyncio.create_task(self._watch_stalls(
                self.config.engine_stall_timeout))
        return results

    async def wait_fatal(self) -> str:
        """Return once the pool is dead for good (a core kept dying); returns why."""
        await self._fatal.wait()
        return self.dead_reason

    def check_admission(self, num_seqs: int, max_queue_len: int) -> None:
        """Raise unless `num_seqs` more sequences may queue: EngineDeadError,
        EngineRestartingError, or QueueFullError beyond `max_queue_len` waiting (the cores'
        waiting queues plus what is still on the wire)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not any(r.is_alive for r in self.replicas):
            raise EngineRestartingError("the engine core is restarting")
        queued = sum(s.num_waiting + sent - s.num_received
                     for s, sent, r in zip(self._replica_stats, self._num_sent, self.replicas)
                     if r.dead_reason is None)
        if queued + num_seqs > max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({queued} sequences waiting)")

    def route(self, request_id: str, prompt_token_ids: Sequence[int], num_seqs: int) -> int:
        """Choose the replica for a request of `num_seqs` sequences and count it there."""
        replica = self.balancer.choose(prompt_token_ids)
        self.balancer.started(replica, num_seqs)
        self.owner[request_id] = (replica, num_seqs)
        return replica

    def add(self, replica: int, message: AddRequests) -> None:
        if not self._has_work(replica):  # an idle core's silence was no stall
            self._last_heard[replica] = time.monotonic()
        self.replicas[replica].send(message)
        self._num_sent[replica] += len(message.requests)

    def finish(self, request_id: str, message: FinishRequests | None) -> None:
        """Release a request and send `message` (if any) to the replica that ran it, if that
        one is still up."""
        replica = self.release(request_id)
        if message is not None and replica is not None and \
                self.replicas[replica].dead_reason is None:
            self.replicas[replica].send(message)

    def send(self, replica: int, message: FinishRequests) -> None:
        self.replicas[replica].send(message)

    async def control(self, message: Control,
                      replicas: Sequence[int] | None = None) -> dict[int, Controlled]:
        """Send `message` to `replicas` (default: every live one) and wait for each one's
        answer; raises EngineDeadError when a replica dies first."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if replicas is None:
            replicas = [i for i, r in enumerate(self.replicas) if r.is_alive]
        if not replicas:
            raise EngineRestartingError("the engine core is restarting")
        loop = asyncio.get_running_loop()
        futures = {}
        for i in replicas:
            futures[i] = loop.create_future()
            self._controls[i].append(futures[i])
            self.replicas[i].send(message)
        return dict(zip(futures, await asyncio.gather(*futures.values())))

    def release(self, request_id: str) -> int | None:
        """Forget which replica serves a request; returns that replica."""
        owner = self.owner.pop(request_id, None)
        if owner is None:
            return None
        self.balancer.finished(*owner)
        return owner[0]

    async def shutdown(self) -> None:
        """Stop the core processes and release the sockets."""
        self.dead_reason = self.dead_reason or "the engine has shut down"
        for task in self._restarts:
            task.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            if replica.process is not None:
                loop.remove_reader(replica.process.sentinel)
        for task in self._output_tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas))

    def _watch(self, replica: int) -> None:
        """Follow a started core: its outputs, and its exit."""
        client = self.replicas[replica]
        asyncio.get_running_loop().add_reader(client.process.sentinel, self._on_core_exit,
                                              replica)
        self._output_tasks[replica] = asyncio.create_task(self._output_loop(replica))

    async def _output_loop(self, replica: int) -> None:
        client = self.replicas[replica]
        while True:
            message = await client.recv()
            self._last_heard[replica] = time.monotonic()
            if isinstance(message, Failed):
                self._replica_died(replica, f"{client.name} failed: {message.error}")
                return
            if isinstance(message, Controlled):
                self._controls[replica].popleft().set_result(message)
                continue
            if isinstance(message, Outputs):
                self._replica_stats[replica] = message.stats
                self.stats = self._live_stats()
            try:
                self.events.on_message(replica, message)
            except Exception as e:  # a bug here must fail requests, not hang them
                logger.exception("output processing failed")
                self._replica_died(replica, f"output processing failed: {e}")
                return

    def _has_work(self, replica: int) -> bool:
        return any(owner == replica for owner, _ in self.owner.values())

    async def _watch_stalls(self, timeout: float) -> None:
        """Kill a core that has requests but has said nothing for `timeout` seconds (it sends
        at least every core_proc.HEARTBEAT_S while it steps): frozen (SIGSTOP), or stuck."""
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for replica, client in enumerate(self.replicas):
                silent = now - self._last_heard[replica]
                if client.is_alive and silent > timeout and self._has_work(replica):
                    self._replica_died(replica, f"{client.name} stopped stepping for "
                                                f"{silent:.1f} s with requests in flight "
                                                f"(--engine-stall-timeout {timeout:g})")
                    client.process.kill()

    def _live_stats(self) -> CoreStats:
        return CoreStats.merge([s for s, r in zip(self._replica_stats, self.replicas)
                                if r.dead_reason is None])

    def _on_core_exit(self, replica: int) -> None:
        client = self.replicas[replica]
        asyncio.get_running_loop().remove_reader(client.process.sentinel)
        self._replica_died(replica, client.exit_reason())

    def _replica_died(self, replica: int, reason: str) -> None:
        """Take the replica out of rotation, hand its requests back and restart it (or, when
        it keeps dying, give up: the pool is dead)."""
        client = self.replicas[replica]
        if client.dead_reason is not None:
            return
        client.dead_reason = self._death_reasons[replica] = reason
        if client.process is not None:
            asyncio.get_running_loop().remove_reader(client.process.sentinel)
        task = self._output_tasks[replica]
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self.balancer.remove(replica)
        self.stats = self._live_stats()
        owned = [rid for rid, (owner, _) in self.owner.items() if owner == replica]
        while self._controls[replica]:
            self._controls[replica].popleft().set_exception(EngineDeadError(reason))
        for request_id in owned:
            del self.owner[request_id]
        now = time.monotonic()
        deaths = [t for t in self._deaths[replica] if now - t < RESTART_WINDOW_S] + [now]
        self._deaths[replica] = deaths
        if self.dead_reason is not None:
            return
        if len(deaths) > self.max_core_restarts:
            self.dead_reason = (f"{reason}; it died {len(deaths)} times within "
                                f"{RESTART_WINDOW_S:.0f} s, so it is not restarted again")
            logger.error("%s", self.dead_reason)
            self.events.on_engine_dead(self.dead_reason)
            self._fatal.set()
            return
        logger.error("%s; its %d requests go on when a core is up", reason, len(owned))
        task = asyncio.create_task(self._restart(replica, len(deaths)))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        self.events.on_requests_lost(owned, reason)

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
        self._replica_stats[replica] = CoreStats()
        self._num_sent[replica] = 0
        self._last_heard[replica] = time.monotonic()
        self._death_reasons[replica] = None
        self.balancer.alive[replica] = True  # back in rotation, with nothing routed to it
        self._watch(replica)
        logger.warning("%s is serving again", client.name)
        self.events.on_replica_restarted(ready)
