"""The KV connector contract: moving KV-cache blocks between the engine and somewhere else (a
host-memory or disk tier, another instance), split as vLLM's `KVConnectorBase_V1` is.

A connector has two sides. Its **scheduler side** lives in the engine core beside the KV-cache
manager: it says which of a request's blocks it can supply, learns which device blocks were
given for them, hears of blocks leaving the prefix cache, and writes each step's orders for the
workers. Its **worker side** lives in every worker (one per rank): it holds the rank's KV tensors
and carries the orders out around the forward pass. Plugins add connectors through the hook
`runtime_register_kv_connectors`; `--kv-transfer-config '{"kv_connector": NAME, ...}'` picks one.

Order of calls in one engine step:

1. scheduler side, while the step is scheduled: `get_num_new_matched_tokens` for each request
   being admitted, `update_state_after_alloc` once its blocks are given, `on_evict` for each
   cached block handed out again; then `build_connector_meta` once.
2. each worker, before the forward (and before the step's requests touch their blocks):
   `start_load_kv(meta)`, which carries the orders out or starts them; during the forward,
   in each attention layer, `wait_for_layer_load(name)` before it reads the cache and
   `save_kv_layer(name, metadata)` once it wrote the step's K and V; after the forward
   `wait_for_save()`, then `get_finished()`.
3. scheduler side, with every rank's `KVConnectorOutput` merged: `update_connector_output`;
   `request_finished` for each request that ended, and when that gave orders, one more
   `build_connector_meta` whose orders every worker carries out at once (no forward), before
   the step's outputs leave the engine.

Loads are finished within the step that ordered them: a request whose blocks are loaded is
admitted without compute in that step and computed from the next step on, and a block whose
load failed on any rank is computed again, never read half-written. The per-layer hooks are
called only for a connector that overrides one of them (it then runs every step eagerly: a
captured graph's replay would skip the calls); the built-in connectors move whole blocks at
the step's edges. Everything here is plain data or torch; nothing imports the engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


class ConnectorRequest(Protocol):
    """What the scheduler side sees of a request (the engine's `runtime.request.Request`)."""

    request_id: str
    # the chained hash of each full block of its known tokens, as far as the engine computed
    # them (the prefix-cache keys; the same on every instance of the same model and settings)
    block_hashes: list[bytes]
    num_tokens: int  # prompt + generated so far
    num_prompt_tokens: int
    num_computed_tokens: int
    lora_int_id: int  # the adapter it runs under, 0 for the base model
    # the request's `kv_transfer_params` (vLLM's: SamplingParams.extra_args
    # ["kv_transfer_params"], the OpenAI routes' field), None when it has none
    kv_transfer_params: dict[str, Any] | None


@dataclass(frozen=True)
class KVConnectorContext:
    """What both sides are built with."""

    role: str  # one of KV_ROLES
    block_size: int  # tokens per block
    # names the KV layout (model, dtype, cache dtype, block size, parallel layout): blocks saved
    # under one namespace are only ever loaded under the same
    namespace: str
    extra_config: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    # the bytes of one block over every layer and every rank (sizes a tier in blocks)
    bytes_per_block: int = 0
    world_size: int = 1  # ranks of the engine (tensor x pipeline parallel)
    rank: int = 0  # the worker side's global rank (0 on the scheduler side)


@dataclass
class KVCacheLayer:
    """One attention layer's cache as a worker holds it: `tensor` is addressed by block id along
    dimension `block_dim` (the layout is the attention backend's)."""

    name: str
    tensor: torch.Tensor
    block_dim: int


@dataclass
class KVConnectorOutput:
    """What a worker's side reports after a step. The engine merges every rank's."""

    # request id -> the index (in its block table) of the first block whose load failed: that
    # block and those after it are computed again
    failed_loads: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0

    def merge(self, other: "KVConnectorOutput") -> "KVConnectorOutput":
        failed = dict(self.failed_loads)
        for request_id, index in other.failed_loads.items():
            failed[request_id] = min(index, failed.get(request_id, index))
        return KVConnectorOutput(failed, self.bytes_loaded + other.bytes_loaded,
                                 self.bytes_saved + other.bytes_saved,
                                 max(self.load_seconds, other.load_seconds),
                                 max(self.save_seconds, other.save_seconds))


class KVConnectorScheduler(ABC):
    """The scheduler side. Built once per engine core with the `KVConnectorContext` and the
    number of blocks of the KV cache (`num_blocks`, the same on every rank)."""

    def __init__(self, context: KVConnectorContext, num_blocks: int) -> None:
        self.context = context

    @staticmethod
    def check_kv_transfer_params(params: dict[str, Any], role: str) -> None:
        """Called in the API process for a request that carries `kv_transfer_params`: raise
        ValueError naming what this connector does not take (a 400 on the server)."""
        raise ValueError("kv_transfer_params: this KV connector takes none")

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int | None:
        """Called when a waiting request is about to be admitted, after the local prefix cache
        gave it `num_computed_tokens` (a multiple of the block size). Returns how many tokens
        past those the connector can load (a multiple of the block size; never the request's
        last token, which is always computed); 0: none. None: not known yet (the KV is still
        on its way from another instance): the request stays waiting, others go past it, and
        it is asked again next step (vLLM's WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 first_block: int, num_blocks: int) -> None:
        """Called once the request holds blocks for what `get_num_new_matched_tokens` promised:
        `block_ids[first_block:first_block + num_blocks]` are to be loaded this step."""

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """Called when a free block that held the cached prefix block `block_hash` is handed out
        again: its contents are still there until this step's forward writes over it."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """Called once per step, after scheduling: the step's orders for the workers (picklable;
        sent to every rank). The connector forgets them afterwards. Called again after the
        step when `request_finished` gave orders: those run at once, in a step of their own."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> dict | None:
        """Called when a request finishes or is aborted, while it still holds `block_ids`
        (its KV is intact until the next step's forward). The connector may order them kept
        (saved, sent); the engine carries such orders out before the step's outputs leave.
        Returns the `kv_transfer_params` for the request's output (what another instance needs
        to find this KV), or None."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Called after the step with every rank's `KVConnectorOutput` merged."""

    def flush(self, cached_blocks: list[tuple[int, bytes]]) -> Any:
        """Called once when the engine stops, with every block its prefix cache holds as
        (block id, hash), least recently used first: orders for one last step in which the
        workers keep what should outlive the engine (as `build_connector_meta` returns them),
        or None."""
        return None

    def stats(self) -> dict[str, float]:
        """Cumulative counters for /metrics (name -> value); names are the connector's own."""
        return {}

    def shutdown(self) -> None:
        """Called when the engine core stops."""


class KVConnectorWorker(ABC):
    """The worker side, one per rank, built with the `KVConnectorContext` (its `rank` set)."""

    def __init__(self, context: KVConnectorContext) -> None:
        self.context = context

    @abstractmethod
    def register_kv_caches(self, layers: list[KVCacheLayer]) -> None:
        """Called once the worker's KV cache is allocated (and again if it is reallocated)."""

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Called before the step's forward with this step's `build_connector_meta()`, before
        any block it names is written by the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called in each attention layer (named as in `register_kv_caches`) during the
        forward, before it reads its cache: a connector whose loads run in the background
        waits here until that layer's blocks are in."""

    def save_kv_layer(self, layer_name: str, metadata: Any) -> None:
        """Called in each attention layer that keeps a cache, once it wrote this step's K and V
        (`metadata` is the step's attention metadata: its slot mapping says where): a
        connector that saves during the forward starts copying that layer's blocks."""

    def wait_for_save(self) -> None:
        """Called after the forward, before `get_finished`: the saves started in
        `save_kv_layer` must be complete when it returns (the blocks may be written again
        from the next step on)."""

    @property
    def uses_layer_hooks(self) -> bool:
        """Whether this connector overrides a per-layer hook (else none is called)."""
        base = KVConnectorWorker
        return any(getattr(type(self), name) is not getattr(base, name)
                   for name in ("wait_for_layer_load", "save_kv_layer"))

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Called at the end of the step: what this rank did (and what failed)."""

    def shutdown(self) -> None:
        """Called when the worker stops."""


@dataclass(frozen=True)
class KVConnectorClasses:
    """A connector as `runtime_register_kv_connectors` names it: its two sides, each a class or
    a "package.module:ClassName" string imported only when the connector is used."""

    scheduler: type[KVConnectorScheduler] | str
    worker: type[KVConnectorWorker] | str
