"""The attention backends the CUDA platform offers, each usable or refused with the reason."""
from __future__ import annotations

from dataclasses import replace

import torch

from runtime.attention_backends.flash_attention import PAGE_MULTIPLE, FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import mla_candidates, module_available, offer_backend
from runtime.plugins.interfaces import BackendCandidate, ModelInfo

PLUGIN = "cuda"


def attention_candidates(cc: tuple[int, int], model: ModelInfo) -> list[BackendCandidate]:
    """Every backend the CUDA platform knows, offered or refused for a GPU of compute
    capability `cc` and this model."""
    cc_text = ".".join(map(str, cc))

    def needs(library: str, min_cc: tuple[int, int]) -> list[str]:
        problems = [] if module_available(library) else [f"{library} is not installed"]
        if cc < min_cc:
            problems.append(f"needs compute capability {min_cc[0]}.{min_cc[1]}+, "
                            f"this GPU has {cc_text}")
        return problems

    triton = needs("triton", (7, 5))
    if model.dtype == torch.bfloat16 and cc < (8, 0):
        triton.append(f"bfloat16 needs compute capability 8.0+, this GPU has {cc_text}")
    if model.attention_kind == "mla":
        return mla_candidates(model, "cuda", PLUGIN, triton)
    flash = needs("flash_attn", (8, 0))
    if model.block_size % PAGE_MULTIPLE:
        flash.append(f"its paged KV needs --block-size a multiple of {PAGE_MULTIPLE} "
                     f"(got {model.block_size}); run with --block-size {PAGE_MULTIPLE} to use it")
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
