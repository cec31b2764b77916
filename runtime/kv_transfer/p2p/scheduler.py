"""The P2pTcpConnector's scheduler side.

Producer: a request with `do_remote_decode` has its handed-over prompt blocks copied to host
memory when it finishes (an order run before its output leaves), and its output's
kv_transfer_params name this instance's `kv_ip` / `kv_port` (rank r listens on kv_port + r).

Consumer: a request with `do_remote_prefill` gets the blocks the params promise, and each rank
fetches them from the producer's rank during the step that admits it (in the background, while
the step's forward computes the other requests), checking the block hashes
against the prompt's own; a fetch that fails (the producer is gone, the KV expired, another
prompt's KV) has those blocks computed (vLLM's "recompute" load-failure policy).
"""
from __future__ import annotations

from typing import Any

from runtime.kv_transfer import disagg
from runtime.plugins.kv_connector import ConnectorRequest, KVConnectorContext

DEFAULT_IP = "127.0.0.1"
DEFAULT_PORT = 14579

# Orders, carried out in order by every worker:
#   ("stage", request_id, block_ids, hashes)      device blocks -> host memory, served
#   ("fetch", host, port, remote_request_id, first, hashes, block_ids, request_id)


class P2pTcpScheduler(disagg.DisaggScheduler):
    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        super().__init__(context, num_blocks)
        self.ip = str(context.extra_config.get("kv_ip", DEFAULT_IP))
        self.port = int(context.extra_config.get("kv_port", DEFAULT_PORT))

    @staticmethod
    def check_kv_transfer_params(params: dict[str, Any], role: str) -> None:
        disagg.check(params, role)
        if params.get("do_remote_prefill"):
            missing = [k for k in ("remote_host", "remote_port", "remote_request_id")
                       if k not in params]
            if missing:
                raise ValueError(f"kv_transfer_params.do_remote_prefill needs {missing}: "
                                 "where the prefill instance serves the KV")

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.context.block_size
        return max(0, disagg.wanted_blocks(request, self.context) - first) * \
            self.context.block_size

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 first_block: int, num_blocks: int) -> None:
        params = request.kv_transfer_params
        end = first_block + num_blocks
        self.orders.append(("fetch", params["remote_host"], params["remote_port"],
                            params["remote_request_id"], first_block,
                            request.block_hashes[first_block:end], block_ids[first_block:end],
                            request.request_id))
        self.counters["loaded_blocks"] += num_blocks

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> dict | None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None
        num_blocks = disagg.handed_over_blocks(request, self.context.block_size)
        self.orders.append(("stage", request.request_id, block_ids[:num_blocks],
                            request.block_hashes[:num_blocks]))
        self.counters["saved_blocks"] += num_blocks
        return disagg.produced(request, self.engine_id, self.context, num_blocks,
                               remote_host=self.ip, remote_port=self.port)
