"""`kv_transfer_params` as the SharedStorageConnector reads and writes them (vLLM's keys).

A request to the prefill instance carries `{"do_remote_decode": true}`; its output carries what
the decode instance needs: `{"do_remote_prefill": true, "do_remote_decode": false,
"remote_engine_id", "remote_request_id", "remote_num_tokens", "remote_namespace"}`, which the
proxy passes on with the same prompt. The KV is found by the prompt's own block hashes, so a
decode instance never reads another prompt's KV whatever the params say.
"""
from __future__ import annotations

from typing import Any

FLAGS = ("do_remote_decode", "do_remote_prefill")
KNOWN = (*FLAGS, "remote_engine_id", "remote_request_id", "remote_num_tokens",
         "remote_namespace")
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
    for name in ("remote_engine_id", "remote_request_id", "remote_namespace"):
        if not isinstance(params.get(name, ""), str):
            raise ValueError(f"kv_transfer_params.{name} must be a string, got {params[name]!r}")
