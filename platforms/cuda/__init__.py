"""The built-in CUDA platform plugin (NVIDIA GPUs; `pip install runtime[cuda]`).

Detection asks torch.cuda; nothing CUDA-specific is imported until a hook needs it. Its hooks
answer only for the platform named "cuda":

- attention: FlashAttention 2 (priority 30), FlashInfer (20), our Triton paged kernel (10, the
  backend that is always there), the portable torch backend (0); each offered or refused by
  compute capability, installed libraries and the model's shape, with the reason;
- graph runner: decode steps recorded as CUDA graphs, eager with `--enforce-eager`;
- communicator: NCCL;
- quantization kernels: fp8 w8a8 through torch._scaled_mm on compute capability 8.9+
  (`runtime.quantization.cuda`); every other method runs its portable reference kernel.
"""
from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend
from runtime.attention_backends.flash_attention import PAGE_MULTIPLE, FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import module_available, offer_backend
from runtime.platforms.cuda.graph_runner import CudaGraphRunner
from runtime.platforms.cuda.platform import CudaPlatform, detect_cuda
from runtime.platforms.distributed import TorchDistCommunicator
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec, EagerRunner,
                                GraphRunner, ModelInfo, Platform, PlatformCandidate)
from runtime.plugins.selection import choose_attention_backend

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
                     f"(got {model.block_size})")
    triton = needs("triton", (7, 5))
    if model.dtype == torch.bfloat16 and cc < (8, 0):
        triton.append(f"bfloat16 needs compute capability 8.0+, this GPU has {cc_text}")
    return [
        offer_backend("flash_attn", FlashAttentionBackend, 30, model, "cuda", PLUGIN, flash),
        offer_backend("flashinfer", FlashInferBackend, 20, model, "cuda", PLUGIN,
                      needs("flashinfer", (7, 5))),
        offer_backend("triton_paged", TritonPagedAttention, 10, model, "cuda", PLUGIN, triton),
        offer_backend("torch_paged", TorchPagedAttention, 0, model, "cuda", PLUGIN, []),
    ]


@hookimpl
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate] | None:
    if platform.name != "cuda":
        return None
    return attention_candidates(platform, model)


@hookimpl
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    if platform.name != "cuda":
        return None
    return choose_attention_backend(attention_candidates(platform, model), requested, "cuda")


@hookimpl
def runtime_graph_runner(platform: Platform, enforce_eager: bool) -> GraphRunner | None:
    if platform.name != "cuda":
        return None
    return EagerRunner() if enforce_eager else CudaGraphRunner()


@hookimpl
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    if platform.name != "cuda":
        return None
    return TorchDistCommunicator(spec, "nccl", torch.device("cuda", torch.cuda.current_device()))


@hookimpl
def runtime_quantization_kernel(platform: Platform, method: str, params: dict):
    if platform.name != "cuda":
        return None
    from runtime.quantization.cuda import cuda_quantization_kernel
    return cuda_quantization_kernel(method, params, platform.capability)
