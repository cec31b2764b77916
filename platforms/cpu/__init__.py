"""The built-in CPU platform plugin.

It drives torch's cpu device: detection always succeeds, at priority 0 so that any accelerator
outranks it. Everything else the CPU answers (attention backends, custom ops, graph runner,
communicator, quantization kernels) is a method of `CpuPlatform`, reached through the hooks'
default implementations; a platform gets those answers only by subclassing `CpuPlatform`.
"""
from __future__ import annotations

from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate
from runtime.platforms.cpu.platform import CpuPlatform

CPU_PRIORITY = 0


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    """The host CPU is always usable."""
    return [PlatformCandidate("cpu", CpuPlatform(), CPU_PRIORITY)]
