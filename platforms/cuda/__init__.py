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

from dataclasses import replace

import torch

from runtime.attention_backends.flash_attention import PAGE_MULTIPLE, FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.cuda.platform import CudaPlatform, detect_cuda
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import BackendCandidate, ModelInfo, PlatformCandidate

CUDA_PRIORITY = 100
PLUGIN = "cuda"


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    devices, reason = detect_cuda()
    platform = CudaPlatform(devices) if devices else None
    return [PlatformCandidate("cuda", platform, CUDA_PRIORITY, reason)]


def attention_candidates(platform: CudaPlatform, model: ModelInfo) -> list[BackendCandidate]:
    """Every backend the CUDA platform knows, offered or refused for this GPU and model."""
    cc = platform.capability
    cc_text = ".".join(map(str, cc))

    def needs(library: str, min_cc: tuple[int, int]) -> list[str]:
        problems = [] if module_available(library) else [f"{library} is not installed"]
        if cc < min_cc:
            problems.append(f"needs compute capability {min_cc[0]}.{min_cc[1]}+, "
                            f"this GPU has {cc_text}")
        return problems

    flash = needs("flash_attn", (8, 0))
    if model.block_size % PAGE_MULTIPLE:
        flash.append(f"its paged KV needs --block-size a multiple of {PAGE_MULTIPLE} "
                     f"(got {model.block_size}); run with --block-size {PAGE_MULTIPLE} to use it")
    triton = needs("triton", (7, 5))
    if model.dtype == torch.bfloat16 and cc < (8, 0):
        triton.append(f"bfloat16 needs compute capability 8.0+, this GPU has {cc_text}")
    return [
        offer_backend("flash_attn", FlashAttentionBackend, 30, model, "cuda", PLUGIN, flash),
        flashinfer_candidate(model, needs("flashinfer", (7, 5))),
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "cuda", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "cuda", PLUGIN, []),
    ]


def flashinfer_candidate(model: ModelInfo, problems: list[str]) -> BackendCandidate:
    """FlashInfer plans each step on the host, which a CUDA graph cannot record: while graphs
    are on it ranks below triton_paged (whose decode steps are recorded), above it when eager."""
    if model.enforce_eager:
        priority, note = 20, "ranked above triton_paged: execution is eager, nothing is recorded"
    else:
        priority, note = 5, ("ranked below triton_paged while CUDA graphs are on (its host-side "
                             "plan cannot be recorded); chosen with --enforce-eager or "
                             "--attention-backend flashinfer")
    candidate = offer_backend("flashinfer", FlashInferBackend, priority, model, "cuda", PLUGIN,
                              problems)
    return replace(candidate, reason=note) if candidate.backend is not None else candidate
