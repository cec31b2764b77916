"""The SharedStorageConnector's worker side: this rank's files of the shared folder, written
and read as `SharedStorageScheduler` orders (see there)."""
from __future__ import annotations

import time
from typing import Any

from runtime.kv_transfer.offload import disk
from runtime.kv_transfer.shared_storage.scheduler import storage_folder
from runtime.plugins.kv_connector import (KVCacheLayer, KVConnectorContext, KVConnectorOutput,
                                          KVConnectorWorker)


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, context: KVConnectorContext) -> None:
        super().__init__(context)
        self.folder = storage_folder(context)
        self.layers: list[KVCacheLayer] = []
        self.output = KVConnectorOutput()

    def register_kv_caches(self, layers: list[KVCacheLayer]) -> None:
        self.layers = layers

    def start_load_kv(self, meta: Any) -> None:
        out = self.output
        for order in meta or ():
            started = time.perf_counter()
            if order[0] == "save":
                _, block_id, block_hash = order
                out.bytes_saved += disk.write_block(self._path(block_hash), self._block(block_id))
                out.save_seconds += time.perf_counter() - started
                continue
            _, block_hash, block_id, request_id, index = order
            if request_id in out.failed_loads:  # a block before it failed: computed anyway
                continue
            target = self._block(block_id)
            blocks = disk.read_block(self._path(block_hash), target)
            if blocks is None:
                self._path(block_hash).unlink(missing_ok=True)
                out.failed_loads[request_id] = index
            else:
                for source, block in zip(blocks, target):
                    block.copy_(source)
                out.bytes_loaded += sum(t.nbytes for t in target)
            out.load_seconds += time.perf_counter() - started

    def _block(self, block_id: int) -> list:
        return [layer.tensor.select(layer.block_dim, block_id) for layer in self.layers]

    def _path(self, block_hash: bytes):
        return disk.block_path(self.folder, block_hash, self.context.rank)

    def get_finished(self) -> KVConnectorOutput:
        output, self.output = self.output, KVConnectorOutput()
        return output
