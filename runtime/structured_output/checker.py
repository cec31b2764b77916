"""The API process's grammar checks, in worker processes: a constraint is built by the grammar
backend (xgrammar or llguidance, native code) where a crash or a runaway build kills a worker,
never the server, and the event loop only waits. Bounded: at most `workers` checks at once, each
at most `timeout_s` (its worker is killed past it, or when the client leaves) and `max_bytes` of
constraint text; results are kept in an LRU bounded in bytes."""
from __future__ import annotations

import asyncio
import multiprocessing
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from runtime.structured_output.params import StructuredOutputsParams

MAX_ERROR_CHARS = 1000  # of a backend's message sent back from a worker
STARTUP_TIMEOUT_S = 300.0  # for a worker to import its backend (seconds on a busy machine)


class GrammarLimitError(ValueError):
    """A constraint past one of the checker's limits (its message names the limit)."""


def _serve(conn: Connection, backend: str) -> None:
    """A worker: import the backend, say so, then check one constraint at a time until told to
    stop (None) or its parent goes."""
    from runtime.structured_output.backends import check
    check(StructuredOutputsParams(regex="a"), backend)  # imports the backend's native module
    conn.send("ready")
    while True:
        try:
            params = conn.recv()
        except EOFError:
            return
        if params is None:
            return
        try:
            check(params, backend)
            conn.send(None)
        except ValueError as e:
            conn.send(str(e)[:MAX_ERROR_CHARS])
        except RecursionError:
            conn.send(f"structured_outputs.{params.kind} nests too deeply to be compiled")


class _Worker:
    def __init__(self, context: Any, backend: str) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, backend), daemon=True,
                                       name="grammar-check")
        self.process.start()
        child.close()
        self.ready: asyncio.Future | None = None

    async def wait_ready(self) -> None:
        if self.ready is None:
            self.ready = asyncio.ensure_future(self._receive())
        if await asyncio.shield(self.ready) != "ready":
            raise RuntimeError("a grammar check worker failed to start")

    async def ask(self, params: StructuredOutputsParams) -> str | None:
        """The backend's error for `params`, or None when it takes them."""
        self.conn.send(params)
        return await self._receive()

    async def _receive(self) -> Any:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self.conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(self.conn.fileno())
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(1)
            raise _Crashed(self.process.exitcode) from None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(1)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(1)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()


class _Crashed(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(exitcode)
        self.exitcode = exitcode


class CheckCache:
    """Checked constraints (their key and the backend's error, None when valid), least recently
    used dropped past `max_bytes` (a key's size is its text's)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple, str | None] = OrderedDict()

    @staticmethod
    def _size(key: tuple, error: str | None) -> int:
        return len(key[1]) + len(error or "") + 100  # the key's text and the entry's overhead

    def get(self, key: tuple) -> tuple[bool, str | None]:
        if key not in self._entries:
            return False, None
        self._entries.move_to_end(key)
        return True, self._entries[key]

    def put(self, key: tuple, error: str | None) -> None:
        size = self._size(key, error)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = error
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, old_error = self._entries.popitem(last=False)
            self.bytes -= self._size(old, old_error)


class GrammarChecker:
    """Checks constraints for the grammar `backend` in up to `workers` processes, each started
    when a check first needs it (importing a backend takes seconds: a server that is never
    asked for a constraint never pays for it) and replaced whenever one is killed."""

    def __init__(self, backend: str, workers: int = 2, timeout_s: float = 10.0,
                 max_bytes: int = 2**20, cache_bytes: int = 64 * 2**20) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache = CheckCache(cache_bytes)
        self._context = multiprocessing.get_context("spawn")
        self._num_workers = workers
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None

    async def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming what is wrong when the backend cannot take `params`, or a
        GrammarLimitError when checking them passes a limit."""
        key = params.key
        if len(key[1]) > self.max_bytes:
            raise GrammarLimitError(
                f"structured_outputs.{params.kind} is {len(key[1])} bytes long, over the "
                f"server's limit of {self.max_bytes} bytes (--max-grammar-bytes)")
        known, error = self.cache.get(key)
        if not known:
            error = await self._ask(params)
            self.cache.put(key, error)
        if error is not None:
            raise ValueError(error)
        params._checked_by = self.backend

    async def _ask(self, params: StructuredOutputsParams) -> str | None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._num_workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else _Worker(self._context, self.backend)
            try:
                await asyncio.wait_for(worker.wait_ready(), STARTUP_TIMEOUT_S)
            except (_Crashed, asyncio.TimeoutError) as e:
                worker.kill()  # the next check starts a new one
                how = f"exit code {e.exitcode}" if isinstance(e, _Crashed) else \
                    f"not ready after {STARTUP_TIMEOUT_S:g} s"
                raise RuntimeError(f"a grammar check worker failed to start ({how})") from None
            except BaseException:
                self._idle.append(worker)  # cancelled while it starts: it is still good
                raise
            try:
                error = await asyncio.wait_for(worker.ask(params), self.timeout_s)
            except asyncio.TimeoutError:
                worker.kill()
                raise GrammarLimitError(
                    f"structured_outputs.{params.kind} took longer than the server's limit "
                    f"of {self.timeout_s:g} s to check (--grammar-check-timeout)") from None
            except _Crashed as e:
                worker.kill()
                return (f"structured_outputs.{params.kind} cannot be compiled: the grammar "
                        f"library ({self.backend}) crashed on it (exit code {e.exitcode})")
            except BaseException:  # cancelled: the client left, or the server stops
                worker.kill()
                raise
            self._idle.append(worker)
            return error

    def shutdown(self) -> None:
        for worker in self._idle:
            worker.stop()
        self._idle = []
