"""The built-in XPU platform plugin (Intel GPUs; `pip install runtime[xpu]` with torch's XPU wheel).

Attention: IPEX's paged attention when intel-extension-for-pytorch is installed (priority 20),
our Triton paged kernel (10; Triton compiles for Intel GPUs through Intel's XPU backend), the
portable torch backend (0). Execution is eager. Collectives: torch's native "xccl" backend where
torch has it, else oneCCL's "ccl" from oneccl_bindings_for_pytorch. The plugin's one hook is
detection; the rest are methods of `XpuPlatform`.
"""
from __future__ import annotations

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


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_xpu()
    return [PlatformCandidate("xpu", XpuPlatform(devices) if devices else None, XPU_PRIORITY,
                              reason)]


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    ipex = [] if module_available(IPEX) else [f"{IPEX} is not installed"]
    triton = [] if module_available("triton") else ["triton (Intel XPU backend) is not installed"]
    return [
        offer_backend("ipex_paged", IpexPagedAttention, 20, model, "xpu", PLUGIN, ipex),
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "xpu", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "xpu", PLUGIN, []),
    ]
