"""The index of a hybrid model's recurrent-state checkpoints: which block hashes have the state
at their block's end in the workers' host store (`runtime.layers.recurrent_state`), and in
which of its entries.

A checkpoint is made by the step that computes the last token of its block, found by the chained
hash of that block, and dropped when the hash leaves the prefix cache; when the store is full
the least recently used entry goes first. The entries a step reads (restores) or writes are
pinned until the step's message is built, so no later order of the same step reuses them; the
ones it writes are pending until then: no request resumes from them in the step that makes
them (`ready`).
"""
from __future__ import annotations

from collections import OrderedDict


class CheckpointIndex:
    def __init__(self, num_entries: int) -> None:
        self.num_entries = num_entries
        self.entry_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # entries in use, least recent first
        self.free = list(range(num_entries - 1, -1, -1))  # pop() takes entry 0
        self.pinned: set[int] = set()
        self.pending: set[int] = set()  # written by the step being scheduled
        self.num_evicted = 0  # dropped to make room (not with their block)

    def __len__(self) -> int:
        return len(self.entry_of)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.entry_of.get(block_hash)

    def ready(self, block_hash: bytes) -> int | None:
        """The entry holding the checkpoint of `block_hash`, unless this step writes it."""
        entry = self.entry_of.get(block_hash)
        return None if entry in self.pending else entry

    def use(self, entry: int) -> None:
        """A step restores from `entry`: it becomes the most recently used, pinned."""
        self.lru.move_to_end(entry)
        self.pinned.add(entry)

    def add(self, block_hash: bytes) -> int | None:
        """The entry a step writes the checkpoint of `block_hash` into (pinned, pending),
        evicting the least recently used unpinned one when none is free; None when every entry
        is pinned."""
        if self.free:
            entry = self.free.pop()
        else:
            entry = next((e for e in self.lru if e not in self.pinned), None)
            if entry is None:
                return None
            del self.entry_of[self.hash_of.pop(entry)]
            del self.lru[entry]
            self.num_evicted += 1
        self.entry_of[block_hash] = entry
        self.hash_of[entry] = block_hash
        self.lru[entry] = None
        self.pinned.add(entry)
        self.pending.add(entry)
        return entry

    def drop(self, block_hash: bytes) -> None:
        """The block named `block_hash` left the prefix cache: its checkpoint goes with it."""
        entry = self.entry_of.pop(block_hash, None)
        if entry is not None:
            del self.hash_of[entry]
            del self.lru[entry]
            self.pinned.discard(entry)
            self.pending.discard(entry)
            self.free.append(entry)

    def end_step(self) -> None:
        """The step's message is built: its checkpoints will be written before the next."""
        self.pinned.clear()
        self.pending.clear()
