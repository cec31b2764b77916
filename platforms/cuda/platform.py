"""The CUDA platform: NVIDIA GPUs through torch.cuda.

Detection reads only what torch.cuda reports (build, device count, properties); the tests fake
exactly those calls. The KV cache gets what is left of `--gpu-memory-utilization` x the device's
memory once the weights, the profiled activation peak and memory outside torch's allocator (the
CUDA context, other processes) are taken out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                        EagerRunner, GraphRunner, ModelInfo, Platform)

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_MEMORY_UTILIZATION = 0.9
# the recurrent layers' one-token ops that `recurrent_triton` has kernels for
RECURRENT_DECODE_OPS = ("causal_conv1d_update", "fused_recurrent_gated_delta_rule",
                        "mamba2_state_update")
# the chunked prefill scans that `chunk_triton` has kernels for
RECURRENT_CHUNK_OPS = ("mamba2_chunk_scan", "chunk_gated_delta_rule")
# the causal conv's prefill and Mamba 1's scan and update, in `conv_scan_triton`
CONV_SCAN_OPS = ("causal_conv1d", "selective_scan", "selective_state_update")


@dataclass(frozen=True)
class GpuDevice:
    """What torch.cuda reports about one visible device."""

    index: int
    name: str
    capability: tuple[int, int]  # (major, minor); for ROCm torch reports the gfx version here
    total_memory: int
    arch: str = ""  # ROCm: gcnArchName, e.g. "gfx942:sramecc+:xnack-"


def visible_devices() -> list[GpuDevice]:
    """Every device torch.cuda sees (CUDA or HIP, whichever torch was built for)."""
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(GpuDevice(i, p.name, (p.major, p.minor), p.total_memory,
                                 getattr(p, "gcnArchName", "")))
    return devices


def detect_cuda() -> tuple[list[GpuDevice], str]:
    """The visible NVIDIA devices, or none and why not."""
    if torch.version.hip:
        return [], f"torch is built for ROCm (HIP {torch.version.hip}), not CUDA"
    if not torch.version.cuda:
        return [], "torch is built without CUDA (a CPU-only wheel); `pip install runtime[cuda]`"
    if not torch.cuda.is_available():
        return [], (f"no CUDA device visible (torch built for CUDA {torch.version.cuda}; check "
                    "the driver and CUDA_VISIBLE_DEVICES)")
    devices = visible_devices()
    if not devices:
        return [], "torch.cuda reports no device"
    return devices, ""


def kv_cache_budget(requested: int | None, free: int, total: int, reserved: int,
                    model_bytes: int, utilization: float, device_name: str) -> int:
    """KV-cache bytes on one device: `requested` if given, else utilization x total, less the
    model (weights + activation peak) and memory held outside torch's allocator."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"KV-cache memory must be positive, got {requested} bytes")
        if requested > free:
            raise ValueError(f"--kv-cache-memory asks for {requested / GiB:.2f} GiB but "
                             f"{device_name} has {free / GiB:.2f} GiB free")
        return requested
    outside_torch = max(total - free - reserved, 0)  # CUDA context, NCCL, other processes
    budget = int(total * utilization) - model_bytes - outside_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache on {device_name}: --gpu-memory-utilization "
            f"{utilization} allows {total * utilization / GiB:.2f} GiB, the model needs "
            f"{model_bytes / GiB:.2f} GiB and {outside_torch / GiB:.2f} GiB is held outside "
            "torch; raise --gpu-memory-utilization or use a smaller model")
    return budget


class CudaPlatform(Platform):
    """One process drives one device (`device(local_rank)`); bf16 where the GPU computes it.

    Device calls go through `torch.<device_type>` (torch.cuda here, torch.xpu for the XPU
    subclass), whose memory API is the same.
    """

    name = "cuda"
    device_type = "cuda"

    def __init__(self, devices: list[GpuDevice]) -> None:
        self.devices = devices
        self.memory_utilization = DEFAULT_MEMORY_UTILIZATION

    @property
    def accel(self) -> Any:
        """torch's module for this device type (torch.cuda, torch.xpu)."""
        return getattr(torch, self.device_type)

    @property
    def capability(self) -> tuple[int, int]:
        """The lowest compute capability among the visible devices (kernels must run on all)."""
        return min(d.capability for d in self.devices)

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, local_rank % len(self.devices))

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.capability >= (8, 0) else torch.float16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.capability >= (8, 0):
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)

    def set_device(self, device: torch.device) -> None:
        self.accel.set_device(device)

    def synchronize(self) -> None:
        self.accel.synchronize()

    def empty_cache(self) -> None:
        self.accel.empty_cache()

    def set_memory_utilization(self, fraction: float | None) -> None:
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
            self.memory_utilization = fraction

    def measure_peak_memory(self, run: Callable[[], Any]) -> int:
        accel = self.accel
        device = accel.current_device()
        accel.synchronize(device)
        accel.empty_cache()
        before = accel.memory_allocated(device)
        accel.reset_peak_memory_stats(device)
        run()
        accel.synchronize(device)
        peak = accel.max_memory_allocated(device) - before
        accel.empty_cache()
        return max(peak, 0)

    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        accel = self.accel
        device = accel.current_device()
        free, total = accel.mem_get_info(device)
        return kv_cache_budget(requested, free, total, accel.memory_reserved(device),
                               model_bytes, self.memory_utilization, self.devices[device].name)

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        from runtime.platforms.cuda.attention import attention_candidates
        return attention_candidates(self.capability, model)

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        """Decode steps recorded as CUDA graphs; eager with `--enforce-eager`."""
        from runtime.platforms.cuda.graph_runner import CudaGraphRunner
        return EagerRunner() if enforce_eager else CudaGraphRunner()

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        """NCCL (RCCL on ROCm, through torch's "nccl" backend)."""
        from runtime.platforms.distributed import TorchDistCommunicator
        device = torch.device("cuda", torch.cuda.current_device())
        return TorchDistCommunicator(spec, "nccl", device)

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        """fp8 w8a8 through torch._scaled_mm on compute capability 8.9+."""
        from runtime.quantization.cuda import cuda_quantization_kernel
        return cuda_quantization_kernel(method, params, self.capability)

    def custom_op(self, name: str) -> Callable | None:
        """Multi-LoRA's lora_shrink / lora_expand, fused_moe, the recurrent layers' decode ops,
        chunked scans, causal conv prefill and Mamba 1 scan as Triton kernels; the portable
        rest."""
        if name in ("lora_shrink", "lora_expand"):
            from runtime.platforms.cuda import lora_triton
            return getattr(lora_triton, name)
        if name in RECURRENT_DECODE_OPS:
            from runtime.platforms.cuda import recurrent_triton
            return getattr(recurrent_triton, name)
        if name in RECURRENT_CHUNK_OPS:
            from runtime.platforms.cuda import chunk_triton
            return getattr(chunk_triton, name)
        if name in CONV_SCAN_OPS:
            from runtime.platforms.cuda import conv_scan_triton
            return getattr(conv_scan_triton, name)
        if name == "fused_moe":
            from runtime.platforms.cuda.fused_moe_triton import fused_moe
            return fused_moe
        return None

    def describe(self) -> dict[str, Any]:
        first = self.devices[0]
        return {
            "devices": f"{len(self.devices)} x {first.name}",
            "compute capability": ".".join(map(str, self.capability)),
            "memory per device": f"{first.total_memory / GiB:.1f} GiB",
            "torch CUDA": torch.version.cuda,
            "default dtype": str(self.default_dtype()).removeprefix("torch."),
            "memory utilization": self.memory_utilization,
        }
