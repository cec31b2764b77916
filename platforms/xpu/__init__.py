"""The built-in XPU platform plugin (Intel GPUs; `pip install runtime[xpu]` with torch's XPU wheel).

Everything runs on torch's own XPU support and Triton; IPEX is optional. Attention: our Triton
paged kernel (priority 10; Triton compiles for Intel GPUs through Intel's XPU backend, shipped
with torch's XPU wheels), IPEX's paged attention when intel-extension-for-pytorch is installed
(5: IPEX has had no release after 2.8 and is maintained only until March 2026, so it is chosen
when forced or when Triton is missing), the portable torch backend (0). Execution is eager.
Collectives: torch's native "xccl" backend where torch has it, else oneCCL's "ccl" from
oneccl_bindings_for_pytorch. The plugin's one hook is detection; the rest are methods of
`XpuPlatform`.
"""
from __future__ import annotations

from runtime.platforms.xpu.platform import XpuPlatform, detect_xpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate

XPU_PRIORITY = 100


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_xpu()
    return [PlatformCandidate("xpu", XpuPlatform(devices) if devices else None, XPU_PRIORITY,
                              reason)]
