"""The plugin contract: every hook a plugin may implement.

Version HOOK_API_VERSION. A plugin is any object or module with functions marked `@hookimpl` whose
names match the specs below. Built-in platforms (`platforms/*`) are registered like any other plugin;
third-party ones arrive through the entry-point group `runtime.plugins`.

Conventions, as in pytest:
- a `firstresult` hook stops at the first non-None answer; `@hookimpl(tryfirst=True)` lets a plugin
  answer before the built-in platforms (e.g. a faster CPU attention backend shipped in a wheel);
- every other hook collects the answers of all plugins into a list;
- a hook may accept only some of the spec's arguments (pluggy passes those it names).

The hooks are called by the engine at start-up (never per step), in the order they appear here.
"""
from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "runtime"
HOOK_API_VERSION = 1
ENTRY_POINT_GROUP = "runtime.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def runtime_detect_platforms() -> list[Any]:
    """Say which devices this plugin can drive here.

    Called once, when the engine picks its platform (and by `runtime plugins`).
    Receives nothing. Returns a list of `runtime.plugins.interfaces.PlatformCandidate`: for each device
    family the plugin knows, the `Platform` object (or None, with `reason`, when the device or its
    libraries are absent) and a priority. All answers are collected; the usable candidate with the
    highest priority wins unless the user forces one with `--device` / `RUNTIME_DEVICE`.
    """


@hookspec(firstresult=True)
def runtime_attention_backend(platform: Any, model: Any, requested: str | None) -> Any:
    """Choose the attention backend for this platform, model and KV-cache dtype.

    Called once per engine, after the model config is known and before the KV cache is allocated.
    `platform` is the chosen `Platform`; `model` is a `runtime.plugins.interfaces.ModelInfo` (head sizes,
    dtypes, sliding window); `requested` is the user's `--attention-backend` name or None.
    Returns an `runtime.attention_backends.base.AttentionBackend` subclass, or None to let the next plugin
    answer. A plugin that cannot honour `requested` for its own platform raises ValueError saying why.
    First non-None answer wins.
    """


@hookspec
def runtime_attention_backend_candidates(platform: Any, model: Any) -> list[Any]:
    """List the attention backends this plugin considers for this platform and model, with why.

    Called by `runtime plugins` and whenever selection is explained; a platform plugin usually
    decides `runtime_attention_backend` from the same list with
    `runtime.plugins.backend_choice.choose_attention_backend`. Receives what `runtime_attention_backend`
    receives, less `requested`. Returns a list of `runtime.plugins.interfaces.BackendCandidate` — the
    unusable ones too, each with its reason — or None for platforms the plugin does not serve.
    All answers are collected.
    """


@hookspec(firstresult=True)
def runtime_graph_runner(platform: Any, model: Any, enforce_eager: bool) -> Any:
    """Choose how the forward pass is executed (eager, torch.compile, CUDA/HIP graphs, XLA).

    Called once per worker after the model is loaded. Returns a `runtime.plugins.interfaces.GraphRunner`
    instance, or None (the engine then runs eagerly). The engine calls the runner's `capture`
    with the model's forward, its `capture_graphs` with a `runtime.plugins.interfaces.CaptureSpec` once
    the KV cache exists, then `run` every step. First non-None answer wins.
    """


@hookspec(firstresult=True)
def runtime_communicator(platform: Any, spec: Any) -> Any:
    """Supply collectives for one process group.

    Called once per group (tensor, pipeline, data parallel) on every rank, when the worker starts.
    `spec` is a `runtime.plugins.interfaces.CommunicatorSpec`. Returns a `runtime.plugins.interfaces.Communicator`
    (gloo, NCCL, RCCL, oneCCL, XLA …). First non-None answer wins.
    """


@hookspec(firstresult=True)
def runtime_quantization_kernel(platform: Any, method: str, params: dict) -> Any:
    """Supply the kernel for a quantization method on this platform.

    Called once per quantization method when the model is built. `method` is the method's name
    (e.g. "int8", "int4", "fp8", "gguf"); `params` describes the layout (bits, group size, dtypes).
    Returns a kernel object as documented by that method in `quantization/`, or None to fall back
    to the method's portable torch reference kernel. First non-None answer wins.
    """


@hookspec(firstresult=True)
def runtime_custom_op(platform: Any, name: str) -> Any:
    """Replace a named layer op.

    Called once per op name when the model's layers are built. The names and signatures (the
    portable implementations live in `runtime/layers`):

    - "rms_norm": (x, weight, eps) -> normed x
    - "add_rms_norm": (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    - "silu_and_mul": (x) -> silu(x[..., :d]) * x[..., d:]
    - "rotary_embedding": (positions, query, key, cos_sin_cache, head_size) -> (query, key)
      rotated; query/key are [T, heads * head_size] and may be rotated in place
    - "fused_moe": (hidden, w13, w2, topk_weights, topk_ids) -> [T, H], the experts' gated-silu
      MLPs (w13 [E, 2I, H] gate | up, w2 [E, H, I]) summed with the routing weights
    - "linear": (weight) -> fn(x, bias) computing F.linear(x, weight, bias); called once per
      dense (unquantized) layer and the LM head after loading, so it may pre-pack the weight

    Each name is asked for on its own, so a plugin may replace one and keep the others.
    Returns a callable with that signature, or None to keep the portable one. First non-None
    answer wins.
    """


@hookspec
def runtime_register_models() -> dict[str, Any]:
    """Add model architectures.

    Called once, when the model registry is first consulted. Returns a dict that maps a Hugging
    Face architecture name (config.json's `architectures[0]`) to a model class, or to a string
    "package.module:ClassName" imported only when that architecture is loaded. All answers are
    collected; a plugin's entry replaces a built-in one of the same name.
    """


@hookspec
def runtime_logits_processors() -> list[Callable] | None:
    """Add logits processors to sampling.

    Called once per model runner, when it is built. A processor is a callable
    `(logits, batch) -> logits`: `logits` is the step's float32 [rows, vocab] tensor on the
    device, `batch` the step's `runtime.sampling.SamplingBatch`, one row per sampled position
    (k + 1 rows for a request verifying k proposals). Processors run after the engine's own
    adjustments (grammar mask, allowed_token_ids, bad_words, min_tokens, logit_bias,
    penalties) and before temperature, top-k/top-p/min-p and the draw, for greedy and random
    rows alike; they return a new tensor or modify `logits` in place. Returns a list of
    processors, or None. All answers are collected and run in the order they were collected.
    """
