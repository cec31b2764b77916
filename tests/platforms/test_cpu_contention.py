"""Re-sharing a rank's threads while it runs (`platforms/cpu/contention.py`): which cores a
sample says were lost, the other processes' load once unpinned, when the share changes, and the
schedstat counts it reads (the `release_threads` kernel is tested with `bind_threads` in
test_cpu_threads.py)."""
from __future__ import annotations

import os

import pytest

from runtime.platforms.cpu import contention
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

    def __init__(self, samples: list, count: int) -> None:
        self.samples, self.calls, self.now = iter(samples), [], 0.0
        super().__init__(0, [0, 1], [0], [0, 1], count, clock=lambda: self.now)

    def pin(self) -> None:
        self.pinned, self.count = {0: 100, 1: 101}, 2
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


def test_a_share_busy_at_start_up_begins_unpinned():
    share = ScriptedShare([({0: (0, 0), 1: (0, 0)}, 0)], count=1)
    assert share.calls == ["release 1"]


def test_thread_times_reads_this_threads_schedstat():
    times = contention.thread_times(os.getpid())  # the main thread's id is the process id
    if times is None:
        pytest.skip("this kernel keeps no schedstat")
    run, wait = times
    assert run > 0 and wait >= 0
