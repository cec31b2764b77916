"""Collectives for CPU workers: torch.distributed over gloo."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plugins.interfaces import Communicator, CommunicatorSpec


class GlooCommunicator(Communicator):
    """One process group over gloo; `spec.ranks` are global ranks, `spec.rank` is this process's.

    The first communicator built in a process initialises torch.distributed's default group, so
    its ranks must be the whole world, 0..world_size-1 (the engine builds the world group first).
    Sub-groups are created with local synchronisation: only their members take part, so each
    rank builds just the groups it belongs to.
    """

    def __init__(self, spec: CommunicatorSpec) -> None:
        ranks = sorted(spec.ranks)
        if spec.rank not in ranks:
            raise ValueError(f"rank {spec.rank} is not in the group's ranks {spec.ranks}")
        if not dist.is_initialized():
            if ranks != list(range(len(ranks))):
                raise ValueError("the first communicator of a process must cover the whole world "
                                 f"(ranks 0..N-1), got {spec.ranks}")
            dist.init_process_group("gloo", init_method=spec.init_method,
                                    world_size=len(ranks), rank=spec.rank)
        if ranks == list(range(dist.get_world_size())):
            self.group = dist.group.WORLD
        else:
            self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.ranks = ranks
        self.rank = ranks.index(spec.rank)  # torch orders a group's ranks ascending too
        self.world_size = len(ranks)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = _contiguous(tensor)
        dist.all_reduce(buf, group=self.group)
        return tensor if buf is tensor else tensor.copy_(buf)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        buf = _contiguous(tensor)
        dist.recv(buf, src=self.ranks[src], group=self.group)
        return tensor if buf is tensor else tensor.copy_(buf)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # gloo reads and writes flat buffers; a strided view goes through a contiguous copy.
    return tensor if tensor.is_contiguous() else tensor.contiguous()
