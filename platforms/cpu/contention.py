"""Re-sharing a rank's threads while it runs, when other processes take its cores.

The start-up check (`threads.py`) only sees the load present when the rank starts. A process
that starts later on one of the rank's cores halves the pinned thread there, and every step
waits for that thread (OpenMP joins at each parallel region). Measured on a 2-core AVX2 EPYC,
SmolLM2-135M fp32, 16 x 128 -> 64, a nice-0 busy loop started on CPU 1 after the engine:
two pinned threads 32.7 output tok/s, one thread 36.9, two unpinned 23.7; passive OpenMP
waiting (`OMP_WAIT_POLICY=passive`) 31.5, no better than spinning. So the rank drops the
threads of the cores it lost and runs the rest unpinned, and pins again once they are free.

- **Pinned**: a core is lost when its pinned thread spent at least `WAIT_SHARE` of its runnable
  time waiting for the CPU (the thread's `schedstat`: the kernel counts the wait, so processes
  that give way to the rank, niced ones, cost nothing and are not seen).
- **Unpinned**: the threads may run on any core of the rank's pool (its whole `auto` share,
  which is wider than its cores under `--num-threads`, so a lone thread whose core was taken
  moves to a free one). The other processes' load on the pool is its busy time in /proc/stat
  less this process's own CPU time; the rank pins its cores again when that load is under half
  a core, and otherwise runs one thread per core it leaves, at least one.

A change needs `AGREEING_SAMPLES` samples of `INTERVAL_S` seconds in a row that ask for it.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

from runtime.platforms.cpu import threads

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
WAIT_SHARE = 0.4  # one other runnable process on the core makes this 0.5
AGREEING_SAMPLES = 2
TASKS = Path("/proc/self/task")
OWN_STAT = Path("/proc/self/stat")


def thread_times(tid: int, tasks: Path = TASKS) -> tuple[int, int] | None:
    """(ns running, ns waiting for a CPU) of one thread of this process, from its schedstat;
    None where the kernel keeps no such counts."""
    try:
        run, wait, _ = (tasks / str(tid) / "schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run), int(wait)


def own_ticks(stat: Path = OWN_STAT) -> int:
    """This process's user + system time in clock ticks, the unit of /proc/stat."""
    fields = stat.read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def load_sample() -> tuple[dict[int, tuple[int, int]], int]:
    """The counts `others_load` compares: every CPU's (busy, total) ticks from /proc/stat
    (`threads.cpu_times`) and this process's own ticks."""
    return threads.cpu_times(threads.PROC_STAT.read_text(),
                             not threads.niced_load_yields()), own_ticks()


def lost_cpus(pinned: dict[int, int], before: dict[int, tuple[int, int]],
              after: dict[int, tuple[int, int]]) -> list[int]:
    """The CPUs of `pinned` (CPU -> thread id) whose thread waited at least `WAIT_SHARE` of
    its runnable time between two `thread_times` samples (by thread id)."""
    lost = []
    for cpu, tid in pinned.items():
        if tid in before and tid in after:
            run, wait = (a - b for a, b in zip(after[tid], before[tid]))
            if run + wait > 0 and wait / (run + wait) >= WAIT_SHARE:
                lost.append(cpu)
    return sorted(lost)


def others_load(cpus: list[int], stat_before: dict[int, tuple[int, int]],
                stat_after: dict[int, tuple[int, int]], own_before: int, own_after: int) -> float:
    """Cores' worth of `cpus` that other processes kept busy between two samples: the busy
    time of `cpus` (`threads.cpu_times`) less this process's own."""
    busy = total = 0
    for cpu in cpus:
        if cpu in stat_before and cpu in stat_after:
            busy += stat_after[cpu][0] - stat_before[cpu][0]
            total += stat_after[cpu][1] - stat_before[cpu][1]
    if total <= 0:
        return 0.0
    per_core = total / len(cpus)
    return max(0.0, (busy - (own_after - own_before)) / per_core)


class ThreadShare:
    """The threads of one rank: pinned one per core of `cpus`, or fewer and unpinned on `pool`
    (`cpus` and any other cores of the rank's share) while other processes hold some of its
    cores. `check` is called between steps."""

    def __init__(self, host_rank: int, cpus: list[int], pool: list[int], nodes: list[int],
                 main_cpus: list[int], count: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host_rank, self.cpus, self.pool = host_rank, cpus, pool
        self.nodes, self.main_cpus, self.clock = nodes, main_cpus, clock
        self.pinned: dict[int, int] = {}  # CPU -> the thread pinned to it, while pinned
        self.count = count
        self.wanted: list[tuple[int, bool]] = []  # (count, pinned) the last samples asked for
        self.next_check = clock() + INTERVAL_S
        if count == len(cpus):
            self.pin()
        else:
            self.release(count)
        self.sample = self.read_sample()

    def pin(self) -> None:
        import torch
        tids = torch.ops.runtime_cpu.bind_threads(self.cpus, self.nodes)
        if len(set(tids)) != len(self.cpus):
            logger.warning("binding ran on %d threads for %d CPUs; threads not pinned one "
                           "per core", len(set(tids)), len(self.cpus))
        self.pinned = dict(zip(self.cpus, tids))
        self.count = len(self.cpus)
        os.sched_setaffinity(0, self.main_cpus)

    def release(self, count: int) -> None:
        import torch
        torch.ops.runtime_cpu.release_threads(self.pool, count)
        self.pinned = {}
        self.count = count
        os.sched_setaffinity(0, self.main_cpus)

    def read_sample(self) -> tuple | dict | None:
        """The counts `wanted_count` compares, or None where /proc cannot be read."""
        try:
            return self.take_sample()
        except OSError:
            return None

    def take_sample(self) -> tuple | dict:
        if self.pinned:
            return {tid: times for tid in self.pinned.values()
                    if (times := thread_times(tid)) is not None}
        return load_sample()

    def wanted_state(self, before: tuple | dict, after: tuple | dict) -> tuple[int, bool]:
        """The (thread count, pinned) the last interval asks for."""
        if self.pinned:
            lost = lost_cpus(self.pinned, before, after)
            return (len(self.cpus), True) if not lost else (max(1, len(self.cpus) - len(lost)),
                                                            False)
        load = others_load(self.pool, before[0], after[0], before[1], after[1])
        if load < 0.5:
            return len(self.cpus), True
        return max(1, min(len(self.cpus), len(self.pool) - math.ceil(load - 0.5))), False

    def check(self) -> None:
        """Every `INTERVAL_S`: sample, and change the threads when `AGREEING_SAMPLES` samples
        in a row ask for the same other (count, pinned)."""
        now = self.clock()
        if now < self.next_check:
            return
        self.next_check = now + INTERVAL_S
        after = self.read_sample()
        if after is None or self.sample is None:  # /proc unreadable: keep the threads
            self.sample = after
            return
        wanted = self.wanted_state(self.sample, after)
        self.sample = after
        self.wanted = (self.wanted + [wanted])[-AGREEING_SAMPLES:]
        current = (self.count, bool(self.pinned))
        if wanted == current or self.wanted.count(wanted) < AGREEING_SAMPLES:
            return
        count, pin = wanted
        if pin:
            self.pin()
            logger.info("rank %d: CPUs %s are free again: %d threads pinned", self.host_rank,
                        self.cpus, count)
        else:
            self.release(count)
            logger.warning("rank %d: other processes took cores of CPUs %s while it ran: %d "
                           "unpinned thread(s) on CPUs %s until they leave (%s=%s pins anyway)",
                           self.host_rank, self.cpus, count, self.pool, threads.BIND_ENV,
                           ",".join(map(str, self.cpus)))
        self.wanted = []
        self.sample = self.read_sample()
