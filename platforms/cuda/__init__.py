"""The built-in CUDA platform plugin (NVIDIA GPUs; `pip install runtime[cuda]`).

Detection asks torch.cuda; nothing CUDA-specific is imported until a hook needs it. The plugin's
one hook is detection; what the CUDA platform answers are methods of `CudaPlatform` (which ROCm
and XPU subclass, overriding what differs):

- attention: FlashAttention 2 (priority 30, at --block-size 256), our Triton paged kernel (10,
  the backend that is always there), FlashInfer (5 while CUDA graphs are on, 20 when eager), the
  portable torch backend (0); each offered or refused by compute capability, installed libraries
  and the model's shape, with the reason;
- graph runner: decode steps recorded as CUDA graphs, eager with `--enforce-eager`;
- communicator: NCCL;
- quantization kernels: fp8 w8a8 through torch._scaled_mm on compute capability 8.9+
  (`runtime.quantization.cuda`); every other method runs its portable reference kernel.
"""
from __future__ import annotations

from runtime.platforms.cuda.platform import CudaPlatform, detect_cuda
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate

CUDA_PRIORITY = 100


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_cuda()
    platform = CudaPlatform(devices) if devices else None
    return [PlatformCandidate("cuda", platform, CUDA_PRIORITY, reason)]
