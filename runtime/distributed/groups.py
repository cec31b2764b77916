"""The process groups of one rank, built through the platform's `runtime_communicator` hook."""
from __future__ import annotations

from typing import Any

from runtime.plugins.interfaces import CommunicatorSpec, Platform
from runtime.distributed.layout import ParallelLayout


def init_groups(hook: Any, platform: Platform, layout: ParallelLayout, rank: int,
                init_method: str) -> tuple[Any, Any]:
    """(tensor-parallel group, pipeline group) of `rank`, None where a group has one rank.

    The world group comes first: it sets up the process's default group, which the others need.
    """
    def communicator(ranks: list[int]) -> Any:
        comm = hook.runtime_communicator(platform=platform,
                                         spec=CommunicatorSpec(ranks, rank, init_method))
        if comm is None:
            raise RuntimeError(f"no plugin supplies a communicator for platform "
                               f"{platform.name!r}, needed for {layout.world_size} ranks")
        return comm

    communicator(list(range(layout.world_size)))
    tp = communicator(layout.tp_group(rank)) if layout.tp_size > 1 else None
    pp = communicator(layout.pp_group(rank)) if layout.pp_size > 1 else None
    return tp, pp
