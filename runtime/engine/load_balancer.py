"""Data parallel: which engine replica gets a request.

The least-loaded live replica (sequences routed to it and not yet finished), ties going round
robin. With prefix caching on, requests whose prompts share their first block stick to the
replica that served that block first, where its cached KV is, unless that replica carries
`max_imbalance` more sequences than the least-loaded one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

MAX_PREFIXES = 8192  # remembered first blocks (least recently used forgotten first)


class LoadBalancer:
    def __init__(self, num_replicas: int, block_size: int, prefix_affinity: bool,
                 max_imbalance: int = 8) -> None:
        self.loads = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.max_imbalance = max_imbalance
        self.sticky: OrderedDict[int, int] = OrderedDict()  # first-block hash -> replica
        self._next = 0  # round-robin start among equally loaded replicas

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a prompt; raises RuntimeError when none is alive."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RuntimeError("no data-parallel replica is alive")
        n = len(self.loads)
        least = min(live, key=lambda i: (self.loads[i], (i - self._next) % n))
        self._next = (least + 1) % n
        if not self.prefix_affinity or len(prompt_token_ids) < self.block_size:
            return least
        key = hash(tuple(prompt_token_ids[:self.block_size]))
        replica = self.sticky.get(key)
        if (replica is None or not self.alive[replica]
                or self.loads[replica] - self.loads[least] > self.max_imbalance):
            replica = least
        self.sticky[key] = replica
        self.sticky.move_to_end(key)
        if len(self.sticky) > MAX_PREFIXES:
            self.sticky.popitem(last=False)
        return replica

    def started(self, replica: int, num_seqs: int) -> None:
        self.loads[replica] += num_seqs

    def finished(self, replica: int, num_seqs: int) -> None:
        self.loads[replica] -= num_seqs

    def remove(self, replica: int) -> None:
        """Take a dead replica out of rotation."""
        self.alive[replica] = False
        self.loads[replica] = 0
        self.sticky = OrderedDict((k, r) for k, r in self.sticky.items() if r != replica)
