"""Which KV connectors exist (built-in, then every plugin's `runtime_register_kv_connectors`), and
building a connector's scheduler or worker side for an engine."""
from __future__ import annotations

import hashlib
import importlib
import json
import os

from runtime.attention_backends.base import kv_cache_torch_dtype
from runtime.config import EngineConfig, KVTransferConfig
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource
from runtime.plugins.kv_connector import (KVConnectorClasses, KVConnectorContext,
                                          KVConnectorScheduler, KVConnectorWorker)
from runtime.plugins.manager import get_plugin_manager

BUILT_IN = {
    "OffloadingConnector": KVConnectorClasses(
        "runtime.kv_transfer.offload.scheduler:OffloadScheduler",
        "runtime.kv_transfer.offload.worker:OffloadWorker"),
    "SharedStorageConnector": KVConnectorClasses(
        "runtime.kv_transfer.shared_storage.scheduler:SharedStorageScheduler",
        "runtime.kv_transfer.shared_storage.worker:SharedStorageWorker"),
    "P2pTcpConnector": KVConnectorClasses(
        "runtime.kv_transfer.p2p.scheduler:P2pTcpScheduler",
        "runtime.kv_transfer.p2p.worker:P2pTcpWorker"),
}


def kv_connectors() -> dict[str, KVConnectorClasses]:
    connectors = dict(BUILT_IN)
    for answer in get_plugin_manager().hook.runtime_register_kv_connectors():
        connectors.update(answer or {})
    return connectors


def _class(ref: type | str) -> type:
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _classes(name: str) -> KVConnectorClasses:
    connectors = kv_connectors()
    if name not in connectors:
        raise ValueError(f"unknown kv_connector {name!r}; known: {', '.join(sorted(connectors))}")
    return connectors[name]


def check_kv_transfer_params(config: KVTransferConfig | None, extra_args: dict | None) -> None:
    """Raise ValueError naming what is wrong with a request's kv_transfer_params (in
    SamplingParams.extra_args) for this engine's connector."""
    if not extra_args or extra_args.get("kv_transfer_params") is None:
        return
    if config is None:
        raise ValueError("kv_transfer_params needs a KV connector: start the engine with "
                         "--kv-transfer-config (e.g. SharedStorageConnector)")
    try:
        _class(_classes(config.kv_connector).scheduler).check_kv_transfer_params(
            extra_args["kv_transfer_params"], config.kv_role)
    except ValueError as e:
        raise ValueError(f"{e} ({config.kv_connector})") from None


def _weights_fingerprint(source: ModelSource) -> list:
    """Names, sizes and modification times of the model's files: other weights under the same
    path make another namespace."""
    if os.path.isfile(source.path):
        paths = [source.path]
    else:
        paths = sorted(os.path.join(source.path, n) for n in os.listdir(source.path)
                       if n.endswith((".safetensors", ".bin", ".gguf", ".pt")))
    stats = [(os.path.basename(p), os.stat(p)) for p in paths]
    return [[name, st.st_size, st.st_mtime_ns] for name, st in stats]


def kv_namespace(config: EngineConfig, model_config: ModelConfig, source: ModelSource) -> str:
    """Names the KV layout: the model (its files and config), dtype, KV-cache dtype, block size
    and the parallel layout. Blocks saved under one namespace load only under the same."""
    identity = json.dumps([
        os.path.abspath(source.path), _weights_fingerprint(source),
        model_config.hf_config.to_json_string(), str(model_config.dtype),
        config.kv_cache_dtype, config.block_size, config.tensor_parallel_size,
        config.pipeline_parallel_size, config.attention_backend])
    return hashlib.blake2b(identity.encode(), digest_size=12).hexdigest()


def _context(config: EngineConfig, model_config: ModelConfig, source: ModelSource,
             rank: int) -> KVConnectorContext:
    kt = config.kv_transfer_config
    tp = config.tensor_parallel_size
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model_config.dtype)
    return KVConnectorContext(
        role=kt.kv_role, block_size=config.block_size,
        namespace=kv_namespace(config, model_config, source),
        extra_config=dict(kt.kv_connector_extra_config),
        bytes_per_block=model_config.kv_bytes_per_block(config.block_size, kv_dtype, tp) * tp,
        world_size=tp * config.pipeline_parallel_size, rank=rank)


def build_scheduler_side(config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                         num_blocks: int) -> KVConnectorScheduler | None:
    if config.kv_transfer_config is None:
        return None
    cls = _class(_classes(config.kv_transfer_config.kv_connector).scheduler)
    return cls(_context(config, model_config, source, 0), num_blocks)


def build_worker_side(config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                      rank: int) -> KVConnectorWorker | None:
    if config.kv_transfer_config is None:
        return None
    cls = _class(_classes(config.kv_transfer_config.kv_connector).worker)
    return cls(_context(config, model_config, source, rank))
