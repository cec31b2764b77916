"""The OffloadingConnector's scheduler side: the index of what the host-memory and disk levels
hold, and the orders that keep the workers' copies equal to it.

Blocks evicted from the prefix cache (a free cached block handed out again) are saved to a host
slot; when the host level is full its least recently used block moves to disk (or is dropped
without a disk level), and the disk level drops its least recently used file past its size.
A waiting request whose next blocks are in either level has them loaded into its new blocks.

The orders of a step are one list, carried out in order by every worker before the forward: a
slot is spilled before it is reused, a block is saved before a load writes over it, a spilled
block's file exists before a later order of the same step loads it. So the index can change
within a step without the workers ever reading what an order has not yet written.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from runtime.kv_transfer.offload import disk
from runtime.plugins.kv_connector import (ConnectorRequest, KVConnectorContext,
                                          KVConnectorOutput, KVConnectorScheduler)

# Orders (tuples, cheap to pickle):
#   ("save", block_id, slot)                   device block -> host slot
#   ("save_disk", block_id, hash)              device block -> disk file
#   ("spill", slot, hash)                      host slot -> disk file
#   ("load_host", slot, block_id, request_id, index)
#   ("load_disk", hash, block_id, request_id, index)
#   ("drop_disk", hash)                        delete the block's files


class OffloadScheduler(KVConnectorScheduler):
    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        super().__init__(context, num_blocks)
        extra = context.extra_config
        self.block_size = context.block_size
        bytes_per_block = context.bytes_per_block
        self.num_slots = int(extra.get("host_bytes", 0)) // bytes_per_block
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.host: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recent first
        self.disk: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self.folder = None
        self.disk_capacity = 0
        if extra.get("disk_path"):
            self.folder = disk.tier_folder(extra["disk_path"], context.namespace)
            self.disk_capacity = int(extra.get("disk_bytes", 0)) // bytes_per_block
            found = disk.scan(self.folder, context.world_size)  # a restart finds these
            kept = max(0, len(found) - self.disk_capacity)
            for old in found[:kept]:
                disk.delete(self.folder, old, context.world_size)
            self.disk.update((h, None) for h in found[kept:])
        self.orders: list[tuple] = []
        self.loads: dict[str, list[tuple[int, bytes]]] = {}  # request id -> (index, hash)
        self.counters = {"host_hit_blocks": 0, "disk_hit_blocks": 0, "saved_blocks": 0,
                         "spilled_blocks": 0, "failed_loads": 0, "bytes_loaded": 0,
                         "bytes_saved": 0, "load_seconds": 0.0, "save_seconds": 0.0}

    @property
    def num_disk_blocks(self) -> int:
        return len(self.disk)

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int:
        n = 0
        for block_hash in request.block_hashes[num_computed_tokens // self.block_size:]:
            if block_hash not in self.host and block_hash not in self.disk:
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 first_block: int, num_blocks: int) -> None:
        loads = self.loads.setdefault(request.request_id, [])
        for index in range(first_block, first_block + num_blocks):
            block_hash = request.block_hashes[index]
            if block_hash in self.host:
                self.host.move_to_end(block_hash)
                self.orders.append(("load_host", self.host[block_hash], block_ids[index],
                                    request.request_id, index))
                self.counters["host_hit_blocks"] += 1
            else:
                self.disk.move_to_end(block_hash)
                self.orders.append(("load_disk", block_hash, block_ids[index],
                                    request.request_id, index))
                self.counters["disk_hit_blocks"] += 1
            loads.append((index, block_hash))

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
        elif block_hash in self.disk:
            self.disk.move_to_end(block_hash)
        elif self.num_slots:
            slot = self._take_slot()
            self.orders.append(("save", block_id, slot))
            self.host[block_hash] = slot
            self.counters["saved_blocks"] += 1
        elif self.disk_capacity:
            self._add_to_disk(block_hash)
            self.orders.append(("save_disk", block_id, block_hash))
            self.counters["saved_blocks"] += 1

    def _take_slot(self) -> int:
        """A free host slot; when none is free, the least recent block's, moved to disk first
        (or dropped, without a disk level)."""
        if self.free_slots:
            return self.free_slots.pop()
        victim, slot = self.host.popitem(last=False)
        if self.disk_capacity and victim not in self.disk:
            self._add_to_disk(victim)
            self.orders.append(("spill", slot, victim))
            self.counters["spilled_blocks"] += 1
        return slot

    def _add_to_disk(self, block_hash: bytes) -> None:
        if len(self.disk) >= self.disk_capacity:
            old, _ = self.disk.popitem(last=False)
            self.orders.append(("drop_disk", old))
        self.disk[block_hash] = None

    def build_connector_meta(self) -> Any:
        orders, self.orders = self.orders, []
        return orders

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A failed load's block leaves the index (its file is deleted); the engine computes
        it again."""
        for request_id, index in output.failed_loads.items():
            self.counters["failed_loads"] += 1
            for i, block_hash in self.loads.get(request_id, ()):
                if i == index and block_hash in self.disk:
                    del self.disk[block_hash]
                    self.orders.append(("drop_disk", block_hash))
        self.loads.clear()
        for name in ("bytes_loaded", "bytes_saved", "load_seconds", "save_seconds"):
            self.counters[name] += getattr(output, name)

    def flush(self, cached_blocks: list[tuple[int, bytes]]) -> Any:
        """With a disk level: the host level's blocks, then the device's cached ones, written
        to disk, so a restarted engine finds the whole prefix cache (as far as the disk level
        holds it)."""
        if not self.disk_capacity:
            return None
        for block_hash, slot in list(self.host.items()):
            if block_hash not in self.disk:
                self._add_to_disk(block_hash)
                self.orders.append(("spill", slot, block_hash))
        for block_id, block_hash in cached_blocks:
            if block_hash not in self.disk and block_hash not in self.host:
                self._add_to_disk(block_hash)
                self.orders.append(("save_disk", block_id, block_hash))
        return self.build_connector_meta()

    def stats(self) -> dict[str, float]:
        return dict(self.counters, host_blocks=len(self.host), disk_blocks=len(self.disk))
