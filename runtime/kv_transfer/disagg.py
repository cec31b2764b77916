"""Disaggregated prefill's `kv_transfer_params` (vLLM's keys), as the connectors that hand a
prompt's KV from a prefill instance to a decode instance read and write them.

A request to the prefill instance carries `{"do_remote_decode": true}`; its output carries what
the decode instance needs: `{"do_remote_prefill": true, "do_remote_decode": false,
"remote_engine_id", "remote_request_id", "remote_num_tokens", "remote_namespace"}` (and where
to fetch it from, `remote_host` / `remote_port`, for a socket transport), which the proxy
passes on with the same prompt. The KV is checked against the prompt's own block hashes, so a
decode instance never uses another prompt's KV whatever the params say.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from runtime.plugins.kv_connector import (ConnectorRequest, KVConnectorContext,
                                          KVConnectorOutput, KVConnectorScheduler)

logger = logging.getLogger(__name__)

FLAGS = ("do_remote_decode", "do_remote_prefill")
KNOWN = (*FLAGS, "remote_engine_id", "remote_request_id", "remote_num_tokens",
         "remote_namespace", "remote_host", "remote_port")
PRODUCES = ("kv_producer", "kv_both")
CONSUMES = ("kv_consumer", "kv_both")


def check(params: Any, role: str) -> None:
    """Raise ValueError naming what is wrong with a request's kv_transfer_params for an
    instance of `role`."""
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
    unknown = sorted(set(params) - set(KNOWN))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown keys {unknown}; known: {list(KNOWN)}")
    for name in FLAGS:
        if not isinstance(params.get(name, False), bool):
            raise ValueError(f"kv_transfer_params.{name} must be true or false, "
                             f"got {params[name]!r}")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode (this instance prefills) and "
                         "do_remote_prefill (this instance decodes) exclude each other")
    if params.get("do_remote_decode") and role not in PRODUCES:
        raise ValueError(f"kv_transfer_params.do_remote_decode needs a prefill instance "
                         f"(kv_role kv_producer or kv_both); this one is {role}")
    if params.get("do_remote_prefill") and role not in CONSUMES:
        raise ValueError(f"kv_transfer_params.do_remote_prefill needs a decode instance "
                         f"(kv_role kv_consumer or kv_both); this one is {role}")
    tokens = params.get("remote_num_tokens", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"kv_transfer_params.remote_num_tokens must be an integer >= 0, "
                         f"got {tokens!r}")
    port = params.get("remote_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be a port number, got {port!r}")
    for name in ("remote_engine_id", "remote_request_id", "remote_namespace", "remote_host"):
        if not isinstance(params.get(name, ""), str):
            raise ValueError(f"kv_transfer_params.{name} must be a string, got {params[name]!r}")


def handed_over_blocks(request: ConnectorRequest, block_size: int) -> int:
    """The prompt blocks a prefill instance hands over: its full blocks computed, short of the
    one holding the last prompt token (which the decode instance computes for its logits).
    None under a LoRA adapter: its id starts the hash chain, and another instance may give
    the same id to another adapter."""
    if request.lora_int_id:
        return 0
    return min((request.num_prompt_tokens - 1) // block_size, len(request.block_hashes),
               request.num_computed_tokens // block_size)


def wanted_blocks(request: ConnectorRequest, context: KVConnectorContext) -> int:
    """How many of a decode request's leading blocks the prefill instance handed over (0 when
    it asks for none, runs under a LoRA adapter, or its KV is of another namespace: another
    model or layout)."""
    params = request.kv_transfer_params or {}
    if not params.get("do_remote_prefill") or request.lora_int_id:
        return 0
    if params.get("remote_namespace", context.namespace) != context.namespace:
        logger.warning("request %s: its KV was prefilled under another model or layout "
                       "(KV namespace %s, this instance's %s): computing its prompt",
                       request.request_id, params["remote_namespace"], context.namespace)
        return 0
    return min(params.get("remote_num_tokens", 0) // context.block_size,
               len(request.block_hashes), (request.num_prompt_tokens - 1) // context.block_size)


def produced(request: ConnectorRequest, engine_id: str, context: KVConnectorContext,
             num_blocks: int, **where: Any) -> dict[str, Any]:
    """The kv_transfer_params of a prefill request's output."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_request_id": request.request_id,
            "remote_num_tokens": num_blocks * context.block_size,
            "remote_namespace": context.namespace, **where}


class DisaggScheduler(KVConnectorScheduler):
    """What the scheduler sides of the disaggregated-prefill connectors share: the params'
    check, the step's orders (tuples, carried out in order by every worker) and the counters."""

    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        super().__init__(context, num_blocks)
        self.engine_id = str(context.extra_config.get("engine_id") or uuid.uuid4().hex)
        self.orders: list[tuple] = []
        self.counters = {"saved_blocks": 0, "loaded_blocks": 0, "failed_loads": 0,
                         "timed_out_requests": 0, "bytes_loaded": 0, "bytes_saved": 0,
                         "load_seconds": 0.0, "save_seconds": 0.0}

    @staticmethod
    def check_kv_transfer_params(params: dict[str, Any], role: str) -> None:
        check(params, role)

    def build_connector_meta(self) -> Any:
        orders, self.orders = self.orders, []
        return orders

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.counters["failed_loads"] += len(output.failed_loads)
        for name in ("bytes_loaded", "bytes_saved", "load_seconds", "save_seconds"):
            self.counters[name] += getattr(output, name)

    def stats(self) -> dict[str, float]:
        return dict(self.counters)
