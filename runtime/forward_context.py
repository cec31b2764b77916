"""The attention metadata of the step being run, visible to every attention layer."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from runtime.attention_backends.base import AttentionMetadata

_metadata: AttentionMetadata | None = None


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
