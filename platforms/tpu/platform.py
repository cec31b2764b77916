"""The TPU platform: Google TPUs through torch_xla and its PJRT runtime.

Detection asks PJRT what it drives (`torch_xla.runtime.device_type()` must be "TPU") and how many
devices it sees; the tests fake exactly those answers. torch_xla is imported only here and in the
hooks, never when the plugin loads.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.platforms.common import module_available
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                        EagerRunner, GraphRunner, ModelInfo, Platform)

GiB = 1 << 30
DEFAULT_MEMORY_UTILIZATION = 0.9


def detect_tpu() -> tuple[int, str]:
    """The number of TPU devices PJRT drives, or 0 and why not."""
    if not module_available("torch_xla"):
        return 0, "torch_xla is not installed; `pip install runtime[tpu]`"
    import torch_xla.runtime as xr
    kind = xr.device_type()
    if kind != "TPU":
        return 0, f"PJRT drives {kind!r}, not TPU (on a TPU host, PJRT_DEVICE=TPU)"
    count = xr.global_runtime_device_count()
    return (count, "") if count else (0, "PJRT reports no TPU device")


def memory_info(info: dict[str, int]) -> tuple[int, int]:
    """(bytes in use, bytes limit) from torch_xla's `get_memory_info`, old or new format."""
    if "bytes_limit" in info:
        return info["bytes_used"], info["bytes_limit"]
    total = info["kb_total"] * 1024
    return total - info["kb_free"] * 1024, total


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"

    def __init__(self, num_devices: int) -> None:
        self.num_devices = num_devices
        self.memory_utilization = DEFAULT_MEMORY_UTILIZATION

    def device(self, local_rank: int = 0) -> torch.device:
        import torch_xla.core.xla_model as xm
        return xm.xla_device()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float32)

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm
        xm.wait_device_ops()

    def set_memory_utilization(self, fraction: float | None) -> None:
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
            self.memory_utilization = fraction

    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        import torch_xla.core.xla_model as xm
        used, limit = memory_info(xm.get_memory_info(self.device()))
        if requested is not None:
            if requested > limit - used:
                raise ValueError(f"--kv-cache-memory-bytes asks for {requested / GiB:.2f} GiB but "
                                 f"the TPU has {(limit - used) / GiB:.2f} GiB free")
            return requested
        budget = int(limit * self.memory_utilization) - max(used, model_bytes)
        if budget <= 0:
            raise ValueError(f"no TPU memory left for the KV cache: {used / GiB:.2f} GiB of "
                             f"{limit / GiB:.2f} GiB in use; raise --gpu-memory-utilization")
        return budget

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        from runtime.platforms.tpu.attention import attention_candidates
        return attention_candidates(model)

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        """XLA with bucketed shapes; eager with `--enforce-eager`."""
        from runtime.platforms.tpu.graph_runner import XlaGraphRunner
        return EagerRunner() if enforce_eager else XlaGraphRunner()

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        """torch_xla's "xla" process-group backend."""
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
        from runtime.platforms.distributed import TorchDistCommunicator
        return TorchDistCommunicator(spec, "xla", self.device())

    def ray_resource(self) -> str:
        return "TPU"

    def describe(self) -> dict[str, Any]:
        return {"devices": f"{self.num_devices} TPU cores (PJRT)",
                "default dtype": "bfloat16", "memory utilization": self.memory_utilization}
