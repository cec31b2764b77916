"""The attention metadata of the step being run, and the KV connector whose per-layer hooks the
step calls, visible to every attention layer."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from runtime.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:
    from runtime.plugins.kv_connector import KVConnectorWorker

_metadata: AttentionMetadata | None = None
_kv_connector: "KVConnectorWorker | None" = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make `metadata` the step's metadata; nested contexts (a graph runner padding the step)
    restore the outer one on exit."""
    global _metadata
    outer, _metadata = _metadata, metadata
    try:
        yield
    finally:
        _metadata = outer


def get_forward_context() -> AttentionMetadata:
    if _metadata is None:
        raise RuntimeError("attention ran outside a forward_context (no step metadata set)")
    return _metadata


@contextmanager
def kv_connector_context(connector: "KVConnectorWorker | None") -> Iterator[None]:
    """Make `connector` the one whose `wait_for_layer_load` / `save_kv_layer` each attention
    layer calls during this forward (None: no layer calls)."""
    global _kv_connector
    outer, _kv_connector = _kv_connector, connector
    try:
        yield
    finally:
        _kv_connector = outer


def get_kv_connector() -> "KVConnectorWorker | None":
    return _kv_connector
