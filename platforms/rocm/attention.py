"""The attention backends the ROCm platform offers, each usable or refused with the reason."""
from __future__ import annotations

from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import mla_candidates, module_available, offer_backend
from runtime.plugins.interfaces import BackendCandidate, ModelInfo

PLUGIN = "rocm"


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    triton = [] if module_available("triton") else ["triton is not installed"]
    if model.attention_kind == "mla":
        return mla_candidates(model, "cuda", PLUGIN, triton)
    return [
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "cuda", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "cuda", PLUGIN, []),
    ]
