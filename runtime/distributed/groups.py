"""The process groups of one rank, each from the `runtime_communicator` hook."""
from __future__ import annotations

from typing import Callable

from runtime.plugins.interfaces import Communicator, CommunicatorSpec
from runtime.distributed.layout import ParallelLayout


def init_groups(communicator: Callable[[CommunicatorSpec], Communicator], layout: ParallelLayout,
                rank: int, init_method: str
                ) -> tuple[Communicator | None, Communicator | None, Communicator | None]:
    """(tensor-parallel group, pipeline group, decode-context-parallel group) of `rank`, None
    where a group has one rank;
    `communicator` is the worker's `PlatformAnswers.communicator`.

    The world group comes first: it sets up the process's default group, which the others need.
    """
    def group(ranks: list[int]) -> Communicator:
        return communicator(CommunicatorSpec(ranks, rank, init_method))

    group(list(range(layout.world_size)))
    tp = group(layout.tp_group(rank)) if layout.tp_size > 1 else None
    pp = group(layout.pp_group(rank)) if layout.pp_size > 1 else None
    dcp = group(layout.dcp_group(rank)) if layout.dcp_size > 1 else None
    return tp, pp, dcp
