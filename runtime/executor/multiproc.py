"""One worker process per rank on this machine, started and watched by the engine.

Each step is pickled once and written to every worker's pipe; every worker answers (the rank that
samples with the step's output, the others with None), so an error on any rank surfaces. While
waiting the executor also watches the processes: a worker that dies fails the step at once with
a WorkerError naming it, and the other workers, who may be blocked in a collective with the dead
one, are stopped.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from runtime.plugins.interfaces import Platform
from runtime.config import EngineConfig
from runtime.distributed.layout import ParallelLayout
from runtime.executor.base import Executor, WorkerError, step_output, worker_reply
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource
from runtime.core.messages import StepInput, StepOutput
from runtime.worker.worker import start_worker

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # how often an idle worker checks that the engine is still there
STOP_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 model_config: ModelConfig) -> None:
        self.layout = ParallelLayout.of(config)
        self.dead_reason: str | None = None
        world = self.layout.world_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        level = logging.getLogger("runtime").getEffectiveLevel()
        for rank in range(world):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main, name=f"runtime-worker-{rank}", daemon=True,
                args=(config, platform.name, source, model_config, rank, world, init_method,
                      theirs, level))
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)
        logger.info("started %d worker processes (tp %d x pp %d): %s", world,
                    self.layout.tp_size, self.layout.pp_size,
                    [p.pid for p in self.processes])
        self._finalizer = weakref.finalize(self, stop_workers, self.processes, self.conns)
        self._gather()  # each worker says it has loaded its part of the model

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def state_bytes_per_slot(self) -> int:
        return max(self.collective_rpc("state_bytes_per_slot"))

    def init_kv_cache(self, num_blocks: int, num_checkpoints: int = 0) -> None:
        self.collective_rpc("init_kv_cache", num_blocks, num_checkpoints)

    def execute(self, step: StepInput) -> StepOutput:
        return step_output(self.collective_rpc("execute", step), self.layout.output_rank)

    def check_health(self) -> None:
        if self.dead_reason is not None:
            raise WorkerError(self.dead_reason)
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._fail(self._died(rank))

    def shutdown(self) -> None:
        if self.dead_reason is None:
            self.dead_reason = "the executor has shut down"
        self._finalizer()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self.dead_reason is not None:
            raise WorkerError(self.dead_reason)
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail(self._died(rank))
        return self._gather()

    def _gather(self) -> list[Any]:
        """Every worker's answer, in rank order; raises WorkerError when one dies or fails."""
        results: list[Any] = [None] * len(self.conns)
        pending = set(range(len(self.conns)))
        while pending:
            ready = set(wait([self.conns[r] for r in pending] +
                             [self.processes[r].sentinel for r in pending]))
            for rank in sorted(pending):
                if self.conns[rank] in ready:  # an answer first, even if the process is gone
                    results[rank] = self._answer(rank)
                    pending.discard(rank)
                elif self.processes[rank].sentinel in ready:
                    self._fail(self._died(rank))
        return results

    def _answer(self, rank: int) -> Any:
        try:
            status, value = self.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(self._died(rank))
        if status == "error":
            self._fail(f"worker rank {rank} (pid {self.processes[rank].pid}) failed: {value}")
        return value

    def _died(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(1)
        return (f"worker rank {rank} (pid {process.pid}) died with exit code "
                f"{process.exitcode}")

    def _fail(self, reason: str) -> NoReturn:
        """Stop every worker (the living may be stuck in a collective) and raise."""
        logger.error("%s: stopping the other workers", reason)
        self.dead_reason = reason
        for process in self.processes:
            process.kill()
        self._finalizer()
        raise WorkerError(reason)


def stop_workers(processes: list[multiprocessing.process.BaseProcess],
                 conns: list[Connection]) -> None:
    """Ask the workers to stop, kill those that do not within STOP_TIMEOUT_S, close the pipes.
    Runs once: at shutdown, on failure, or when the executor is collected."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", ())))
        except OSError:
            pass
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def worker_main(config: EngineConfig, platform_name: str, source: ModelSource,
                model_config: ModelConfig, rank: int, world_size: int, init_method: str,
                conn: Connection, log_level: int) -> None:
    """A worker process: load this rank's part of the model, then serve the engine's calls
    until told to stop or until the engine is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    logging.basicConfig(level=log_level if rank == 0 else max(log_level, logging.WARNING),
                        format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    parent = os.getppid()
    keeps_output = rank == ParallelLayout.of(config).output_rank
    try:
        worker = start_worker(config, platform_name, source, model_config, rank, rank, rank,
                              world_size, init_method)
        conn.send(("ok", None))
        while True:
            if not conn.poll(PARENT_POLL_S):
                if os.getppid() != parent:
                    return  # the engine is gone
                continue
            method, args = pickle.loads(conn.recv_bytes())
            if method == "shutdown":
                return
            result = getattr(worker, method)(*args)
            conn.send(("ok", worker_reply(method, result, keeps_output)))
    except (EOFError, BrokenPipeError):
        return  # the engine closed its end
    except Exception as e:
        logging.getLogger(__name__).exception("worker rank %d failed", rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"))
        except OSError:
            pass
        raise SystemExit(1)
