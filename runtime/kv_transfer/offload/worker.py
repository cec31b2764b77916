"""The OffloadingConnector's worker side: this rank's host slots and disk files, and the orders
of `OffloadScheduler` carried out in their order (see there)."""
from __future__ import annotations

import time
from typing import Any

import torch

from runtime.kv_transfer.offload import disk
from runtime.plugins.kv_connector import (KVCacheLayer, KVConnectorContext, KVConnectorOutput,
                                          KVConnectorWorker)


class OffloadWorker(KVConnectorWorker):
    def __init__(self, context: KVConnectorContext) -> None:
        super().__init__(context)
        extra = context.extra_config
        self.host_bytes = int(extra.get("host_bytes", 0))
        self.folder = disk.tier_folder(extra["disk_path"], context.namespace) \
            if extra.get("disk_path") else None
        self.layers: list[KVCacheLayer] = []
        self.slots: list[torch.Tensor] = []  # per layer: the host slots, along its block dim
        self.output = KVConnectorOutput()

    def register_kv_caches(self, layers: list[KVCacheLayer]) -> None:
        """The host slots of every layer (as many as the scheduler side counts: `host_bytes`
        over every rank's share of a block), in the layers' own layout; the memory is reserved,
        not touched, until a slot is used."""
        self.layers = layers
        num_slots = self.host_bytes // self.context.bytes_per_block
        self.slots = []
        for layer in layers:
            shape = list(layer.tensor.shape)
            shape[layer.block_dim] = num_slots
            self.slots.append(torch.empty(shape, dtype=layer.tensor.dtype, device="cpu"))

    def _block(self, block_id: int) -> list[torch.Tensor]:
        return [layer.tensor.select(layer.block_dim, block_id) for layer in self.layers]

    def _slot(self, slot: int) -> list[torch.Tensor]:
        return [s.select(layer.block_dim, slot) for s, layer in zip(self.slots, self.layers)]

    def _path(self, block_hash: bytes):
        return disk.block_path(self.folder, block_hash, self.context.rank)

    def start_load_kv(self, meta: Any) -> None:
        out = self.output
        for order in meta or ():
            kind, started = order[0], time.perf_counter()
            if kind == "save":
                _, block_id, slot = order
                out.bytes_saved += _copy(self._block(block_id), self._slot(slot))
            elif kind == "save_disk":
                _, block_id, block_hash = order
                out.bytes_saved += disk.write_block(self._path(block_hash), self._block(block_id))
            elif kind == "spill":
                _, slot, block_hash = order
                out.bytes_saved += disk.write_block(self._path(block_hash), self._slot(slot))
            elif kind == "load_host":
                _, slot, block_id, request_id, index = order
                out.bytes_loaded += _copy(self._slot(slot), self._block(block_id))
            elif kind == "load_disk":
                _, block_hash, block_id, request_id, index = order
                target = self._block(block_id)
                blocks = disk.read_block(self._path(block_hash), target)
                if blocks is None:
                    out.failed_loads[request_id] = min(index, out.failed_loads.get(request_id,
                                                                                   index))
                else:
                    out.bytes_loaded += _copy(blocks, target)
            elif kind == "drop_disk":
                self._path(order[1]).unlink(missing_ok=True)
            elapsed = time.perf_counter() - started
            if kind.startswith("load"):
                out.load_seconds += elapsed
            else:
                out.save_seconds += elapsed

    def get_finished(self) -> KVConnectorOutput:
        output, self.output = self.output, KVConnectorOutput()
        return output


def _copy(source: list[torch.Tensor], target: list[torch.Tensor]) -> int:
    for s, t in zip(source, target):
        t.copy_(s)
    return sum(t.nbytes for t in target)
