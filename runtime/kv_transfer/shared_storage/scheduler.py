"""The SharedStorageConnector's scheduler side.

Producer (kv_producer, kv_both): a request with `do_remote_decode` has the full blocks of its
prompt saved when it finishes, one file per block and rank named by the block's chained hash
(the offload tier's disk format, checksummed), and its output carries the kv_transfer_params
for the decode instance. The engine carries the saves out before the output leaves.

Consumer (kv_consumer, kv_both): a request with `do_remote_prefill` waits (None from
`get_num_new_matched_tokens`) until the files of the prompt's blocks that the producer saved
are all there, then has them loaded and computes only the rest of the prompt. Past
`load_timeout` seconds it loads what is there and computes the rest; a file that fails its
checksum is deleted and its block computed (vLLM's "recompute" load-failure policy).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from typing import Any

from runtime.kv_transfer.offload import disk
from runtime.kv_transfer.shared_storage import params as kv_params
from runtime.plugins.kv_connector import (ConnectorRequest, KVConnectorContext,
                                          KVConnectorOutput, KVConnectorScheduler)

logger = logging.getLogger(__name__)

DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "runtime_shared_kv")
DEFAULT_LOAD_TIMEOUT_S = 10.0

# Orders (tuples, cheap to pickle), carried out in order by every worker:
#   ("save", block_id, hash)                   device block -> file
#   ("load", hash, block_id, request_id, index)  file -> device block


def storage_folder(context: KVConnectorContext):
    return disk.tier_folder(context.extra_config.get("shared_storage_path", DEFAULT_PATH),
                            context.namespace)


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        super().__init__(context, num_blocks)
        extra = context.extra_config
        self.folder = storage_folder(context)
        self.engine_id = str(extra.get("engine_id") or uuid.uuid4().hex)
        self.load_timeout = float(extra.get("load_timeout", DEFAULT_LOAD_TIMEOUT_S))
        self.orders: list[tuple] = []
        self.waiting_since: dict[str, float] = {}  # request id -> first asked (consumer)
        self.counters = {"saved_blocks": 0, "loaded_blocks": 0, "failed_loads": 0,
                         "timed_out_requests": 0, "bytes_loaded": 0, "bytes_saved": 0,
                         "load_seconds": 0.0, "save_seconds": 0.0}

    @staticmethod
    def check_kv_transfer_params(params: dict[str, Any], role: str) -> None:
        kv_params.check(params, role)

    def _stored(self, block_hash: bytes) -> bool:
        return all(disk.block_path(self.folder, block_hash, rank).exists()
                   for rank in range(self.context.world_size))

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int | None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0
        if params.get("remote_namespace", self.context.namespace) != self.context.namespace:
            logger.warning("request %s: its KV was prefilled under another model or layout "
                           "(KV namespace %s, this instance's %s): computing its prompt",
                           request.request_id, params["remote_namespace"],
                           self.context.namespace)
            return 0
        bs = self.context.block_size
        first = num_computed_tokens // bs
        wanted = min(params.get("remote_num_tokens", 0) // bs, len(request.block_hashes),
                     (request.num_prompt_tokens - 1) // bs)
        found = first
        while found < wanted and self._stored(request.block_hashes[found]):
            found += 1
        if found < wanted:
            since = self.waiting_since.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - since < self.load_timeout:
                return None
            self.counters["timed_out_requests"] += 1
            logger.warning("request %s: %d of its %d prefilled blocks did not arrive within "
                           "%.1f s: computing them", request.request_id, wanted - found,
                           wanted - first, self.load_timeout)
        self.waiting_since.pop(request.request_id, None)
        return max(0, found - first) * bs

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 first_block: int, num_blocks: int) -> None:
        for index in range(first_block, first_block + num_blocks):
            self.orders.append(("load", request.block_hashes[index], block_ids[index],
                                request.request_id, index))
        self.counters["loaded_blocks"] += num_blocks

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> dict | None:
        self.waiting_since.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None
        bs = self.context.block_size
        num_blocks = min((request.num_prompt_tokens - 1) // bs, len(request.block_hashes),
                         request.num_computed_tokens // bs)
        for index in range(num_blocks):
            if not self._stored(request.block_hashes[index]):
                self.orders.append(("save", block_ids[index], request.block_hashes[index]))
                self.counters["saved_blocks"] += 1
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                "remote_num_tokens": num_blocks * bs, "remote_namespace": self.context.namespace}

    def build_connector_meta(self) -> Any:
        orders, self.orders = self.orders, []
        return orders

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.counters["failed_loads"] += len(output.failed_loads)
        for name in ("bytes_loaded", "bytes_saved", "load_seconds", "save_seconds"):
            self.counters[name] += getattr(output, name)

    def stats(self) -> dict[str, float]:
        return dict(self.counters)
