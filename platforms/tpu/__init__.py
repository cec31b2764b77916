"""The built-in TPU platform plugin (`pip install runtime[tpu]`: torch_xla on a TPU host).

Attention: torch_xla's ragged paged attention (a Pallas kernel; priority 20) where the installed
torch_xla has it with the combined K/V cache layout, else our shape-static torch backend
(`xla_paged`, 10). Execution: XLA with bucketed shapes (eager with `--enforce-eager`, which
recompiles for every new shape). Collectives: torch_xla's "xla" process-group backend.
The plugin's one hook is detection; the rest are methods of `TpuPlatform`.
"""
from __future__ import annotations

from runtime.platforms.tpu.platform import TpuPlatform, detect_tpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate

TPU_PRIORITY = 100


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    count, reason = detect_tpu()
    return [PlatformCandidate("tpu", TpuPlatform(count) if count else None, TPU_PRIORITY, reason)]
