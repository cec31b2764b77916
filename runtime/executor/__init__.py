"""Executors: how the engine reaches its workers (in-process, one process per rank, Ray)."""
from __future__ import annotations

from runtime.plugins.interfaces import Platform
from runtime.config import EngineConfig
from runtime.distributed.layout import ParallelLayout, check_model_fits, host_share
from runtime.executor.base import Executor
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource


def build_executor(config: EngineConfig, platform: Platform, source: ModelSource,
                   model_config: ModelConfig) -> Executor:
    """The executor `config.distributed_executor_backend` names (default: uniproc for one
    rank, mp for several), with every worker's part of the model loaded."""
    layout = ParallelLayout.of(config)
    check_model_fits(model_config, layout)
    backend = config.distributed_executor_backend or ("uniproc" if layout.world_size == 1
                                                      else "mp")
    if backend == "uniproc":
        if layout.world_size > 1:
            raise ValueError(f"the uniproc executor runs one rank, but tensor_parallel_size "
                             f"{layout.tp_size} x pipeline_parallel_size {layout.pp_size} "
                             f"asks for {layout.world_size}: choose 'mp' or 'ray'")
        from runtime.executor.uniproc import UniprocExecutor
        from runtime.worker.worker import Worker
        platform.set_threads(config.num_threads, *host_share(config, 0, 1))
        return UniprocExecutor(Worker(config, platform, source, model_config))
    if backend == "mp":
        from runtime.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config, platform, source, model_config)
    from runtime.executor.ray_executor import RayExecutor
    return RayExecutor(config, platform, source, model_config)
