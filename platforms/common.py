"""Helpers the built-in accelerator platforms share: library probes and backend candidates."""
from __future__ import annotations

import importlib.util

import torch

from runtime.attention_backends.base import AttentionBackend
from runtime.plugins.interfaces import BackendCandidate, ModelInfo


def module_available(name: str) -> bool:
    """Whether `name` can be imported here, without importing it (device libraries are heavy)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken stub in sys.modules
        return False


def offer_backend(name: str, backend: type[AttentionBackend], priority: int, model: ModelInfo,
                  device_type: str, plugin: str, problems: list[str]) -> BackendCandidate:
    """A candidate for `backend`: usable unless the platform listed `problems` or the backend's
    own `supports_kv_cache_dtype` or `supports` check refuses the model, its `kind` is not the
    model's `attention_kind`, or the model pools and the backend has no
    `supports_encoder_attention`, or the model has attention sinks and the backend no
    `supports_attention_sinks`, or the model's image tokens attend both ways and the backend
    has no `supports_mm_prefix`; the reason names every problem found.
    `device_type` is torch's device type (`platform.device_type`: "cpu", "cuda", "xla" …), not
    the platform's name; anything torch does not know is refused here, before any backend's
    `supports` sees it."""
    _require_device_type(name, device_type)
    if backend.kind != model.attention_kind:
        kinds = {"mha": "K/V attention", "mla": "multi-head latent attention (MLA)"}
        return BackendCandidate(name, None, priority, (
            f"runs {kinds.get(backend.kind, backend.kind)}; this model's layers are "
            f"{kinds.get(model.attention_kind, model.attention_kind)}"), plugin)
    ok, why = backend.supports_kv_cache_dtype(model.dtype, model.kv_cache_dtype)
    if ok:
        ok, why = backend.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                   model.sliding_window, device_type)
    problems = problems + ([] if ok else [why])
    if model.pooling and not backend.supports_encoder_attention:
        problems.append("no prefill-only (encoder / pooling) attention, which this pooling "
                        "model needs")
    if model.attention_sinks and not backend.supports_attention_sinks:
        problems.append("no attention sinks (a learned logit per head in the softmax), which "
                        "this model needs")
    if model.mm_prefix_lm and not backend.supports_mm_prefix:
        problems.append("no bidirectional attention within an image's tokens "
                        "(mm_prefix_ranges), which this model needs")
    if problems:
        return BackendCandidate(name, None, priority, "; ".join(problems), plugin)
    return BackendCandidate(name, backend, priority, "", plugin)


def _require_device_type(name: str, device_type: str) -> None:
    try:
        known = torch.device(device_type).type == device_type
    except (RuntimeError, TypeError):
        known = False
    if not known:
        raise ValueError(f"offer_backend({name!r}, ...): device_type {device_type!r} is not a "
                         f"torch device type; pass the platform's device_type (\"cpu\", "
                         f"\"cuda\", \"xla\" ...: what its tensors' .device.type is), not its "
                         f"name, nor a device with an index")


def mla_candidates(model: ModelInfo, device_type: str, plugin: str,
                   triton_problems: list[str]) -> list[BackendCandidate]:
    """An accelerator's backends for multi-head latent attention (MLA) models: the Triton
    absorbed-decode kernel (refused with `triton_problems`), then the portable one."""
    from runtime.attention_backends.mla import TorchMLAAttention
    from runtime.attention_backends.mla_triton import TritonMLAAttention
    return [offer_backend("triton_mla", TritonMLAAttention, 10, model, device_type, plugin,
                          triton_problems),
            offer_backend("torch_mla", TorchMLAAttention, 0, model, device_type, plugin, [])]
