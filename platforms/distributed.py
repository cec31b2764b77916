"""Collectives for device workers through torch.distributed (NCCL, RCCL, XCCL, oneCCL)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.plugins.interfaces import Communicator, CommunicatorSpec


class TorchDistCommunicator(Communicator):
    """One process group over a torch.distributed backend, with tensors on `device`.

    `spec.ranks` are global ranks and `spec.rank` is this process's. The first communicator built
    in a process initialises the default group, so its ranks must be the whole world
    (0..world_size-1); later groups are created with local synchronisation, so each rank builds
    just the groups it belongs to. ROCm's RCCL is reached through torch's "nccl" backend.
    """

    def __init__(self, spec: CommunicatorSpec, backend: str, device: torch.device) -> None:
        ranks = sorted(spec.ranks)
        if spec.rank not in ranks:
            raise ValueError(f"rank {spec.rank} is not in the group's ranks {spec.ranks}")
        if not dist.is_initialized():
            if ranks != list(range(len(ranks))):
                raise ValueError("the first communicator of a process must cover the whole world "
                                 f"(ranks 0..N-1), got {spec.ranks}")
            dist.init_process_group(backend, init_method=spec.init_method,
                                    world_size=len(ranks), rank=spec.rank)
        if ranks == list(range(dist.get_world_size())):
            self.group = dist.group.WORLD
        else:
            self.group = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
        self.backend = backend
        self.device = device
        self.ranks = ranks
        self.rank = ranks.index(spec.rank)
        self.world_size = len(ranks)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor.contiguous()  # the libraries reduce flat buffers
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
        buf = tensor.contiguous()
        dist.recv(buf, src=self.ranks[src], group=self.group)
        return tensor if buf is tensor else tensor.copy_(buf)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group,
                                   device=self.device)
        return box[0]
