"""Re-sharing a rank's threads while it runs (`platforms/cpu/contention.py`): which cores a
sample says were lost, the other processes' load once unpinned, when the share changes, and the
schedstat counts it reads (the `release_threads` kernel is tested with `bind_threads` in
test_cpu_threads.py)."""
from __future__ import annotations

import os

import pytest

from runtime.platforms.cpu import contention, threads
from runtime.platforms.cpu.contention import ThreadShare, lost_cpus, others_load, own_ticks


def test_a_core_is_lost_when_its_thread_waits_for_it():
    pinned = {0: 100, 1: 101}
    before = {100: (0, 0), 101: (0, 0)}
    # CPU 0's thread ran 90 % of its runnable time; CPU 1's waited half of it (a fair share
    # with one other process there)
    after = {100: (900, 100), 101: (500, 500)}
    assert lost_cpus(pinned, before, after) == [1]
    assert lost_cpus(pinned, before, {100: (900, 100)}) == []  # a thread with no counts
    assert lost_cpus(pinned, before, before) == []  # threads that slept throughout


def test_others_load_is_busy_time_less_our_own():
    before = {0: (0, 0), 1: (0, 0)}
    after = {0: (100, 100), 1: (100, 100)}  # both cores busy for 100 ticks
    assert others_load([0, 1], before, after, 0, 100) == pytest.approx(1.0)  # we used one
    assert others_load([0, 1], before, after, 0, 200) == pytest.approx(0.0)
    assert others_load([0, 1], before, before, 0, 0) == 0.0
    assert own_ticks() >= 0


class ScriptedShare(ThreadShare):
    """A share whose samples come from a script, and whose pinning is recorded."""

    def __init__(self, samples: list, count: int, cpus: tuple = (0, 1)) -> None:
        self.samples, self.calls, self.now = iter(samples), [], 0.0
        super().__init__(0, list(cpus), [0, 1], [0], [0, 1], count, clock=lambda: self.now)

    def pin(self) -> None:
        self.pinned = {cpu: 100 + cpu for cpu in self.cpus}
        self.count = len(self.cpus)
        self.calls.append("pin")

    def release(self, count: int) -> None:
        self.pinned, self.count = {}, count
        self.calls.append(f"release {count}")

    def take_sample(self) -> tuple:
        return next(self.samples)

    def step(self, seconds: float) -> None:
        self.now += seconds
        self.check()


def test_lost_cores_are_dropped_after_two_samples_and_pinned_again_when_free():
    fair = {100: (0, 0), 101: (0, 0)}
    shared = [fair, {100: (10, 0), 101: (5, 5)}, {100: (20, 0), 101: (10, 10)}]
    busy = ({0: (0, 0), 1: (0, 0)}, 0)  # unpinned: both cores busy, one core of it ours
    busy_samples = [busy, ({0: (100, 100), 1: (100, 100)}, 100),
                    ({0: (200, 200), 1: (200, 200)}, 200)]
    free = [({0: (300, 300), 1: (250, 300)}, 350), ({0: (400, 400), 1: (300, 400)}, 500),
            {100: (0, 0), 101: (0, 0)}]
    share = ScriptedShare(shared + busy_samples + free, count=2)
    assert share.calls == ["pin"]
    share.step(0.5)  # before the interval: no sample taken
    share.step(0.6)
    assert share.calls == ["pin"]  # one sample asking for one thread is not enough
    share.step(1.0)
    assert share.calls == ["pin", "release 1"]
    share.step(1.0)
    share.step(1.0)
    assert share.calls == ["pin", "release 1"]  # the other process still holds a core
    share.step(1.0)
    share.step(1.0)
    assert share.calls == ["pin", "release 1", "pin"]  # it left


def test_a_lone_thread_whose_core_is_taken_runs_unpinned_on_the_pool():
    # `--num-threads 1` pinned to CPU 0 of a two-core share; another process takes CPU 0
    taken = [{100: (0, 0)}, {100: (5, 5)}, {100: (10, 10)}]
    both = ({0: (0, 0), 1: (0, 0)}, 0)  # unpinned: one core each, ours and the other's
    still = [both, ({0: (100, 100), 1: (100, 100)}, 100), ({0: (200, 200), 1: (200, 200)}, 200)]
    share = ScriptedShare(taken + still, count=1, cpus=(0,))
    share.step(1.0)
    share.step(1.0)
    assert share.calls == ["pin", "release 1"]  # one thread, free to move to CPU 1
    share.step(1.0)
    share.step(1.0)
    assert share.calls == ["pin", "release 1"]  # no flip back while the other one runs


def test_losing_every_core_keeps_one_thread():
    both_lost = [{100: (0, 0), 101: (0, 0)}, {100: (5, 5), 101: (5, 5)},
                 {100: (10, 10), 101: (10, 10)}, ({0: (0, 0), 1: (0, 0)}, 0)]
    share = ScriptedShare(both_lost, count=2)
    share.step(1.0)
    share.step(1.0)
    assert share.calls == ["pin", "release 1"]


def test_fewer_threads_than_cores_take_the_free_ones():
    assert threads.idlest([0, 1, 2, 3], {0: 0.9, 1: 0.0, 2: 0.95, 3: 0.1}, 2) == [1, 3]
    assert threads.idlest([0, 1], {}, 1) == [0]
    assert threads.idlest([0, 1], {0: 1.0, 1: 1.0}, 1) == [0]


def test_a_share_busy_at_start_up_begins_unpinned():
    share = ScriptedShare([({0: (0, 0), 1: (0, 0)}, 0)], count=1)
    assert share.calls == ["release 1"]


def test_thread_times_reads_this_threads_schedstat():
    times = contention.thread_times(os.getpid())  # the main thread's id is the process id
    if times is None:
        pytest.skip("this kernel keeps no schedstat")
    run, wait = times
    assert run > 0 and wait >= 0
