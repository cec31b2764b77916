"""The attention backends the TPU platform offers, each usable or refused with the reason."""
from __future__ import annotations

import inspect

from runtime.attention_backends.pallas_ragged import PallasRaggedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.plugins.interfaces import BackendCandidate, ModelInfo

PLUGIN = "tpu"
KERNELS = "torch_xla.experimental.custom_kernel"


def ragged_kernel_problems() -> list[str]:
    """Why torch_xla's ragged paged attention cannot be used here (empty when it can)."""
    if not module_available(KERNELS):
        return [f"{KERNELS} is not available"]
    from torch_xla.experimental import custom_kernel
    kernel = getattr(custom_kernel, "ragged_paged_attention", None)
    if kernel is None:
        return ["this torch_xla has no ragged_paged_attention"]
    if "kv_pages" not in inspect.signature(kernel).parameters:
        return ["this torch_xla's ragged_paged_attention predates the combined K/V layout"]
    return []


def attention_candidates(model: ModelInfo) -> list[BackendCandidate]:
    return [
        offer_backend("pallas_ragged", PallasRaggedAttention, 20, model, "xla", PLUGIN,
                      ragged_kernel_problems()),
        offer_backend("xla_paged", XlaPagedAttention, 10, model, "xla", PLUGIN, []),
    ]
