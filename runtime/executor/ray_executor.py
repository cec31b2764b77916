"""Workers as Ray actors: one per rank, in a placement group of one bundle per rank, on a local
Ray instance or an existing cluster (`--ray-address`, else RAY_ADDRESS, else a new local one).

Ray starts and places the processes; the ranks then talk through the platform's communicator
(gloo, NCCL …) like the multiprocessing workers. Every node needs this package and the model at
the same path.
"""
from __future__ import annotations

import logging
from typing import Any

from runtime.plugins.interfaces import Platform
from runtime.config import EngineConfig
from runtime.distributed.layout import ParallelLayout
from runtime.executor.base import Executor, WorkerError, step_output, worker_reply
from runtime.executor.multiproc import free_port
from runtime.model_config import ModelConfig
from runtime.model_loader.source import ModelSource
from runtime.core.messages import StepInput, StepOutput
from runtime.worker.worker import start_worker

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0


class RayWorker:
    """The actor around one rank's Worker."""

    def __init__(self, keeps_output: bool) -> None:
        self.keeps_output = keeps_output
        self.worker = None

    def node(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def start(self, *args: Any) -> None:
        self.worker = start_worker(*args)

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return worker_reply(method, result, self.keeps_output)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install ray "
                         "(or choose 'mp' for one machine)") from None
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform, source: ModelSource,
                 model_config: ModelConfig) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.ray = ray
        self.layout = layout = ParallelLayout.of(config)
        self.dead_reason: str | None = None
        if not ray.is_initialized():
            ray.init(address=config.ray_address, include_dashboard=False)
        key = platform.ray_resource()  # "CPU", "GPU", "TPU" or a custom resource name
        self.group = placement_group([{key: 1}] * layout.world_size, strategy="PACK")
        self._remove_group = remove_placement_group
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise ValueError(f"the Ray cluster cannot place {layout.world_size} ranks of one "
                             f"{key} each within {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                             f"{ray.available_resources()}")
        if key == "CPU":
            resources: dict[str, Any] = {"num_cpus": 1}
        elif key == "GPU":
            resources = {"num_gpus": 1, "num_cpus": 0}
        else:
            resources = {"resources": {key: 1}, "num_cpus": 0}
        actor_cls = ray.remote(RayWorker)
        self.actors = [
            actor_cls.options(**resources, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)))
            .remote(rank == layout.output_rank) for rank in range(layout.world_size)]
        nodes = self._get([a.node.remote() for a in self.actors])
        master_ip = nodes[0][1]
        init_method = f"tcp://{master_ip}:{self._get([self.actors[0].free_port.remote()])[0]}"
        hosts = [node for node, _ in nodes]
        # Ray gives each actor its own device (it sets the visible devices), hence local rank 0;
        # the host's cores are shared out between the actors on it.
        self._get([a.start.remote(config, platform.name, source, model_config, rank, 0,
                                  hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank]),
                                  init_method)
                   for rank, a in enumerate(self.actors)])
        logger.info("started %d Ray workers (tp %d x pp %d) on %d node(s)", layout.world_size,
                    layout.tp_size, layout.pp_size, len({n for n, _ in nodes}))

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def state_bytes_per_slot(self) -> int:
        return max(self.collective_rpc("state_bytes_per_slot"))

    def init_kv_cache(self, num_blocks: int, num_checkpoints: int = 0) -> None:
        self.collective_rpc("init_kv_cache", num_blocks, num_checkpoints)

    def execute(self, step: StepInput) -> StepOutput:
        return step_output(self.collective_rpc("execute", self.ray.put(step)),
                           self.layout.output_rank)

    def check_health(self) -> None:
        """Only what is known: an actor that died while idle fails the next step."""
        if self.dead_reason is not None:
            raise WorkerError(self.dead_reason)

    def shutdown(self) -> None:
        if self.dead_reason is None:
            self.dead_reason = "the executor has shut down"
        self._stop()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self.dead_reason is not None:
            raise WorkerError(self.dead_reason)
        return self._get([a.call.remote(method, *args) for a in self.actors])

    def _get(self, refs: list[Any]) -> list[Any]:
        """The results in order, failing at the first actor that dies or raises (the others
        may be stuck in a collective with it, so they are not waited for)."""
        ray, pending = self.ray, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as e:
                rank = refs.index(ready[0])
                died = isinstance(e, ray.exceptions.RayActorError)
                self.dead_reason = (f"Ray worker rank {rank} "
                                    f"{'died' if died else 'failed'}: {e}")
                logger.error("%s: stopping the other workers", self.dead_reason)
                self._stop()
                raise WorkerError(self.dead_reason) from None
        return ray.get(refs)

    def _stop(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.group is not None:
            self._remove_group(self.group)
            self.group = None
