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

from dataclasses import replace

from runtime.attention_backends.ipex_paged import IpexPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.xpu.platform import XpuPlatform, detect_xpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import BackendCandidate, ModelInfo, PlatformCandidate

XPU_PRIORITY = 100
PLUGIN = "xpu"
IPEX = "intel_extension_for_pytorch"
IPEX_NOTE = ("ranked below triton_paged: IPEX is maintained only until March 2026; chosen with "
             "--attention-backend ipex_paged or when Triton is missing")


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_xpu()
    return [PlatformCandidate("xpu", XpuPlatform(devices) if devices else None, XPU_PRIORITY,
                              reason)]


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    ipex = [] if module_available(IPEX) else [f"{IPEX} is not installed"]
    triton = [] if module_available("triton") else ["triton (Intel XPU backend) is not installed"]
    ipex_paged = offer_backend("ipex_paged", IpexPagedAttention, 5, model, "xpu", PLUGIN, ipex)
    if ipex_paged.backend is not None:
        ipex_paged = replace(ipex_paged, reason=IPEX_NOTE)
    return [
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "xpu", PLUGIN, triton),
        ipex_paged,
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "xpu", PLUGIN, []),
    ]
