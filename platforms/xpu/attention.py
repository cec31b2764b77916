"""The attention backends the XPU platform offers, each usable or refused with the reason."""
from __future__ import annotations

from dataclasses import replace

from runtime.attention_backends.ipex_paged import IpexPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import mla_candidates, module_available, offer_backend
from runtime.plugins.interfaces import BackendCandidate, ModelInfo

PLUGIN = "xpu"
IPEX = "intel_extension_for_pytorch"
IPEX_NOTE = ("ranked below triton_paged: IPEX is maintained only until March 2026; chosen with "
             "--attention-backend ipex_paged or when Triton is missing")


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    ipex = [] if module_available(IPEX) else [f"{IPEX} is not installed"]
    triton = [] if module_available("triton") else ["triton (Intel XPU backend) is not installed"]
    if model.attention_kind == "mla":
        return mla_candidates(model, "xpu", PLUGIN, triton)
    ipex_paged = offer_backend("ipex_paged", IpexPagedAttention, 5, model, "xpu", PLUGIN, ipex)
    if ipex_paged.backend is not None:
        ipex_paged = replace(ipex_paged, reason=IPEX_NOTE)
    return [
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "xpu", PLUGIN, triton),
        ipex_paged,
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "xpu", PLUGIN, []),
    ]
