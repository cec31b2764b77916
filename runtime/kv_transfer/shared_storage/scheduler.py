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

from runtime.kv_transfer import disagg
from runtime.kv_transfer.offload import disk
from runtime.plugins.kv_connector import ConnectorRequest, KVConnectorContext

logger = logging.getLogger(__name__)

DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "runtime_shared_kv")
DEFAULT_LOAD_TIMEOUT_S = 10.0

# Orders (tuples, cheap to pickle), carried out in order by every worker:
#   ("save", block_id, hash)                   device block -> file
#   ("load", hash, block_id, request_id, index)  file -> device block


def storage_folder(context: KVConnectorContext):
    return disk.tier_folder(context.extra_config.get("shared_storage_path", DEFAULT_PATH),
                            context.namespace)


class SharedStorageScheduler(disagg.DisaggScheduler):
    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        super().__init__(context, num_blocks)
        self.folder = storage_folder(context)
        self.load_timeout = float(context.extra_config.get("load_timeout",
                                                           DEFAULT_LOAD_TIMEOUT_S))
        self.waiting_since: dict[str, float] = {}  # request id -> first asked

    def _stored(self, block_hash: bytes) -> bool:
        return all(disk.block_path(self.folder, block_hash, rank).exists()
                   for rank in range(self.context.world_size))

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int | None:
        first = num_computed_tokens // self.context.block_size
        wanted = disagg.wanted_blocks(request, self.context)
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
        return max(0, found - first) * self.context.block_size

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
        num_blocks = disagg.handed_over_blocks(request, self.context.block_size)
        for index in range(num_blocks):
            if not self._stored(request.block_hashes[index]):
                self.orders.append(("save", block_ids[index], request.block_hashes[index]))
                self.counters["saved_blocks"] += 1
        return disagg.produced(request, self.engine_id, self.context, num_blocks)
