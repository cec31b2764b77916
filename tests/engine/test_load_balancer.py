"""Routing between data-parallel replicas: shortest queue, prefix affinity, dead replicas."""
from __future__ import annotations

import pytest

from runtime.engine.load_balancer import LoadBalancer

BLOCK = 4


def test_shortest_queue_with_round_robin_ties():
    lb = LoadBalancer(3, BLOCK, prefix_affinity=False)
    assert [lb.choose([1, 2]) for _ in range(3)] == [0, 1, 2]  # all idle: take turns
    lb.started(0, 2)
    lb.started(2, 1)
    assert lb.choose([1]) == 1
    lb.started(1, 5)
    assert lb.choose([1]) == 2
    lb.finished(1, 5)
    assert lb.choose([1]) == 1


def test_prefix_affinity_sticks_until_the_replica_is_much_busier():
    lb = LoadBalancer(2, BLOCK, prefix_affinity=True, max_imbalance=3)
    shared = [7, 7, 7, 7]
    first = lb.choose(shared + [1])
    lb.started(first, 1)
    for tail in range(3):  # same first block: same replica, though the other is idle
        assert lb.choose(shared + [tail]) == first
        lb.started(first, 1)
    assert lb.choose(shared + [9]) != first  # 4 more than the other: spill over
    other = 1 - first
    assert lb.choose(shared + [9]) == other  # ...and stick to the new one
    assert lb.choose([7, 7, 7]) == other  # shorter than a block: least loaded


def test_affinity_off_ignores_prefixes():
    lb = LoadBalancer(2, BLOCK, prefix_affinity=False)
    assert [lb.choose([5] * 8) for _ in range(4)] == [0, 1, 0, 1]


def test_dead_replica_leaves_rotation():
    lb = LoadBalancer(2, BLOCK, prefix_affinity=True)
    sticky = lb.choose([3] * 8)
    lb.remove(sticky)
    assert {lb.choose([3] * 8), lb.choose([4] * 8), lb.choose([1])} == {1 - sticky}
    lb.remove(1 - sticky)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        lb.choose([1])
