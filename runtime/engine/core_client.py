"""The API process's end of one engine-core process (one data-parallel replica): spawning it,
waiting until it is ready, and the two sockets to it (see core_proc for the protocol)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile

import msgspec
import zmq
import zmq.asyncio

from runtime.config import EngineConfig
from runtime.engine.core_proc import (AddRequests, Failed, FinishRequests, FromCore, Ready,
                                      Shutdown, run_core_process)
from runtime.model_spec import ModelSpec

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


class CoreClient:
    """`name` is how errors and logs call this core ("the engine core", "data-parallel replica
    1")."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, name: str) -> None:
        self.config = config
        self.spec = spec
        self.name = name
        self.process: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self.ready = False  # loaded, and answering
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._zmq: zmq.asyncio.Context | None = None
        self._dir: str | None = None

    @property
    def is_alive(self) -> bool:
        return self.ready and self.dead_reason is None and self.process.is_alive()

    async def start(self) -> Ready:
        """Spawn the core process and wait until its model is loaded (raises EngineDeadError
        if it fails or exits first)."""
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
            args=(self.config, self.spec, inbox, outbox,
                  logging.getLogger("runtime").getEffectiveLevel()))
        self.process.start()
        logger.info("%s: process %d starting", self.name, self.process.pid)
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: died.done() or died.set_result(None))
        receive = asyncio.ensure_future(self._from_core.recv())
        await asyncio.wait([receive, died], return_when=asyncio.FIRST_COMPLETED)
        loop.remove_reader(self.process.sentinel)
        if not receive.done():
            receive.cancel()
            raise EngineDeadError(f"{self.name} process exited with code "
                                  f"{self.process.exitcode} while loading the model")
        message = self._decoder.decode(receive.result())
        if isinstance(message, Failed):
            raise EngineDeadError(f"{self.name} failed to start: {message.error}")
        assert isinstance(message, Ready)
        self.ready = True
        return message

    async def recv(self) -> FromCore:
        return self._decoder.decode(await self._from_core.recv())

    def send(self, message: AddRequests | FinishRequests | Shutdown) -> None:
        try:
            self._to_core.send(self._encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:  # no core on the other end: its exit fails the requests
            logger.warning("%s is not reachable; %s dropped", self.name, type(message).__name__)

    def exit_reason(self) -> str:
        self.process.join(1)  # reap it, for its exit code
        return f"{self.name} process exited with code {self.process.exitcode}"

    async def shutdown(self) -> None:
        """Stop the core process (killing it after SHUTDOWN_TIMEOUT_S) and release the
        sockets."""
        if self.process is not None and self.process.is_alive():
            if self.dead_reason is None:
                self.send(Shutdown())
            await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
            if self.process.is_alive():
                logger.warning("%s did not stop in %.0f s: killing it", self.name,
                               SHUTDOWN_TIMEOUT_S)
                self.process.kill()
                await asyncio.to_thread(self.process.join)
        self.dead_reason = self.dead_reason or "the engine has shut down"
        if self._zmq is not None:
            self._to_core.close(linger=0)
            self._zmq.destroy(linger=0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
