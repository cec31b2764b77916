"""The acme device: what the engine asks a platform, answered by acme.

acme subclasses the plain `Platform`, not the CPU platform, although it computes on the host:
it gets none of the CPU platform's kernels, only its own answers and the documented defaults.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from runtime.platforms.distributed import TorchDistCommunicator
from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                        ModelInfo, Platform)
from runtime_acme.attention import AcmePagedAttention

KV_CACHE_BYTES = 256 << 20  # acme's cache budget when the user asks for none


def acme_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm as acme computes it: one fused kernel, the portable op's numerics (normalise in
    float32, scale in the input dtype)."""
    return weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


class AcmePlatform(Platform):
    name = "acme"
    device_type = "cpu"  # acme's memory is the host's; torch tensors live on "cpu"
    attention_backend = AcmePagedAttention

    def device(self, local_rank: int = 0) -> torch.device:
        """Every rank's tensors live on the host: rank > 0 (tensor or pipeline parallel) gets
        the same device, never a refusal."""
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        return requested if requested is not None else KV_CACHE_BYTES

    def describe(self) -> dict[str, Any]:
        return {"device": "acme (torch on the host CPU)",
                "default KV cache": f"{KV_CACHE_BYTES >> 20} MiB"}

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        """A hand-built list checks what `offer_backend` would: the KV-cache dtype, the layer
        shape on acme's torch device type, prefill-only attention for a pooling model, attention
        sinks for a model that has them, bidirectional image attention for a model whose image
        tokens attend both ways, and the kind of attention (acme has no MLA backend, so it
        refuses MLA models)."""
        backend = self.attention_backend
        ok, why = backend.supports_kv_cache_dtype(model.dtype, model.kv_cache_dtype)
        if ok:
            ok, why = backend.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                       model.sliding_window, self.device_type)
        if ok and model.pooling and not backend.supports_encoder_attention:
            ok, why = False, "no prefill-only attention, which pooling models need"
        if ok and model.attention_sinks and not backend.supports_attention_sinks:
            ok, why = False, "no attention sinks, which this model needs"
        if ok and model.mm_prefix_lm and not backend.supports_mm_prefix:
            ok, why = False, "no bidirectional attention within an image, which this model needs"
        if ok and backend.kind != model.attention_kind:
            ok, why = False, f"runs {backend.kind} attention; this model's layers are " \
                             f"{model.attention_kind}"
        return [BackendCandidate(backend.name, backend if ok else None, 10, why, plugin="acme")]

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        return TorchDistCommunicator(spec, "gloo", torch.device("cpu"))

    def custom_op(self, name: str) -> Callable | None:
        return acme_rms_norm if name == "rms_norm" else None
