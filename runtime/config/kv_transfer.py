"""`--kv-transfer-config`: which KV connector the engine runs (vLLM's `KVTransferConfig`), and
the offload tier's flags that build one (`--kv-offloading-size`, as vLLM's, and the disk tier)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runtime.plugins.kv_connector import KV_ROLES

OFFLOADING_CONNECTOR = "OffloadingConnector"
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's: a block whose load failed is computed again ("recompute"), or its request ends
    # with an error ("fail")
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_transfer_config needs \"kv_connector\": a connector name "
                             "(`runtime plugins` lists them)")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError("kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got "
                             f"{self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object, "
                             f"got {self.kv_connector_extra_config!r}")

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig | None:
        """From None (no connector), a dict of fields or its JSON text."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError('kv_transfer_config must be an object such as {"kv_connector": '
                             f'"OffloadingConnector", "kv_role": "kv_both"}}, got {value!r}')
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys {unknown}; known: {sorted(known)}")
        return cls(**value)


def offloading_config(host_gib: float | None, disk_path: str | None,
                      disk_gib: float | None) -> KVTransferConfig | None:
    """The OffloadingConnector for `--kv-offloading-size` (host memory, GiB) and
    `--kv-offloading-disk-path` / `--kv-offloading-disk-size`; None when neither tier is asked
    for."""
    if host_gib is None and disk_path is None:
        if disk_gib is not None:
            raise ValueError("--kv-offloading-disk-size needs --kv-offloading-disk-path")
        return None
    for name, value in (("kv_offloading_size", host_gib), ("kv_offloading_disk_size", disk_gib)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} is in GiB and must be >= 0, got {value}")
    extra: dict[str, Any] = {"host_bytes": int((host_gib or 0) * 2**30)}
    if disk_path is not None:
        extra["disk_path"] = disk_path
        extra["disk_bytes"] = int((disk_gib if disk_gib is not None else 16) * 2**30)
    return KVTransferConfig(OFFLOADING_CONNECTOR, "kv_both", extra)
