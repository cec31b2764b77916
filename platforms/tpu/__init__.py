"""The built-in TPU platform plugin (`pip install runtime[tpu]`: torch_xla on a TPU host).

Attention: torch_xla's ragged paged attention (a Pallas kernel; priority 20) where the installed
torch_xla has it with the combined K/V cache layout, else our shape-static torch backend
(`xla_paged`, 10). Execution: XLA with bucketed shapes (eager with `--enforce-eager`, which
recompiles for every new shape). Collectives: torch_xla's "xla" process-group backend.
The plugin's one hook is detection; the rest are methods of `TpuPlatform`.
"""
from __future__ import annotations

import inspect

from runtime.attention_backends.pallas_ragged import PallasRaggedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.tpu.platform import TpuPlatform, detect_tpu
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import BackendCandidate, ModelInfo, PlatformCandidate

TPU_PRIORITY = 100
PLUGIN = "tpu"
KERNELS = "torch_xla.experimental.custom_kernel"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    count, reason = detect_tpu()
    return [PlatformCandidate("tpu", TpuPlatform(count) if count else None, TPU_PRIORITY, reason)]


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
