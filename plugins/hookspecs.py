"""The plugin contract: every hook a plugin may implement.

Version HOOK_API_VERSION. A plugin is any object or module with functions marked `@hookimpl` whose
names match the specs below. Built-in platforms (`platforms/*`) are registered like any other
plugin; third-party ones arrive through the entry-point group `runtime.plugins`.

What one platform answers (its attention backends, graph runner, communicator, quantization
kernels, custom ops) is a method of its `Platform` object (`runtime.plugins.interfaces`). The
hooks carry what crosses plugins: detecting platforms, adding models, and overriding a platform's
answer. The engine always asks the hook; the hooks' default implementation (the plugin named
"platform", `runtime.plugins.platform_answers`) returns the chosen platform's own answer.

How pluggy calls a hook (as in pytest):
- implementations are called in LIFO registration order: the last registered first, so
  entry-point plugins before the built-in platforms; `@hookimpl(tryfirst=True)` moves an
  implementation ahead of all those without it, `trylast=True` behind them (the default
  implementation "platform" is trylast and registered first, so it is always asked last);
- a `firstresult` hook stops at the first non-None answer; every other hook collects the
  answers of all plugins into a list;
- an implementation may accept only some of the spec's arguments (pluggy passes those it names);
- hook wrappers (`@hookimpl(wrapper=True)`) take part in every call: the engine always calls a
  hook through pluggy, never the implementations one by one, and learns who answered from the
  replies the plugin manager records (`runtime.plugins.answers`).

Every hook is called at start-up (never per step); when, is said spec by spec. A worker asks
each question once and keeps the answers, with who gave them, in its `PlatformAnswers`
(`runtime plugins` shows the same record for the active platform).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from runtime.attention_backends.base import AttentionBackend
    from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                            GraphRunner, ModelInfo, Platform, PlatformCandidate)

PROJECT = "runtime"
HOOK_API_VERSION = 3
ENTRY_POINT_GROUP = "runtime.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def runtime_detect_platforms() -> list[PlatformCandidate]:
    """Say which devices this plugin can drive here.

    Called once, when the engine picks its platform (and in each worker process, and by
    `runtime plugins`). Receives nothing. Returns a list of `PlatformCandidate`: for each
    device family the plugin knows, the `Platform` object (or None, with `reason`, when the
    device or its libraries are absent) and a priority. All answers are collected; the usable
    candidate with the highest priority wins unless the user forces one with `--device` /
    `RUNTIME_DEVICE`. An implementation that raises answers nothing and becomes an unusable
    candidate with the error as its reason; the other plugins are still asked.
    """


@hookspec(firstresult=True)
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend] | None:
    """Choose the attention backend for this platform, model and KV-cache dtype.

    Called once per worker (and once more for a draft model's shapes), after the model config
    is known and before the KV cache is allocated. `model` gives head sizes, dtypes and the sliding window;
    with `model.attention_kind == "mla"` (multi-head latent attention) the answer must be an
    `MLAAttentionBackend` (`kind` "mla"), whose `head_size` is the cached latent's width;
    `requested` is the user's `--attention-backend` name or None. Default: the usable candidate
    of highest priority among `platform.attention_backend_candidates(model)`, or the one
    `requested` names, else an `AttentionBackendError` listing every candidate and why. An
    override returns an `AttentionBackend` subclass, or None to let the next implementation
    answer. First non-None answer wins.
    """


@hookspec
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate] | None:
    """List the attention backends this plugin considers for this platform and model, with why.

    Called by `runtime plugins` and whenever selection is explained. Receives what
    `runtime_attention_backend` receives, less `requested`. Default: the platform's own
    `attention_backend_candidates(model)`. A plugin that overrides `runtime_attention_backend`
    lists its backend here too, so the explanation shows it. Returns `BackendCandidate`s (the
    unusable ones too, each with its reason) or None. All answers are collected.
    """


@hookspec(firstresult=True)
def runtime_graph_runner(platform: Platform, model: ModelInfo,
                         enforce_eager: bool) -> GraphRunner | None:
    """Choose how the forward pass is executed (eager, CUDA/HIP graphs, XLA).

    Called once per worker after the model is loaded; `enforce_eager` is `--enforce-eager` (or
    a pipeline-parallel run, or a pooling model). Default: `platform.graph_runner(model,
    enforce_eager)`. Returns a `GraphRunner`; the engine calls its `capture` once with the
    model's forward and a `CaptureSpec` after the KV cache is allocated, then `run` every step.
    First non-None answer wins (None from everyone: the engine runs eagerly).
    """


@hookspec(firstresult=True)
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    """Supply collectives for one process group.

    Called once per group (world, tensor parallel, pipeline) on every rank, when a worker of a
    multi-rank layout starts. Default: `platform.communicator(spec)`. Returns a `Communicator`
    (gloo, NCCL, RCCL, oneCCL, XLA …). First non-None answer wins; None from everyone stops the
    engine with a message naming the platform.
    """


@hookspec(firstresult=True)
def runtime_quantization_kernel(platform: Platform, method: str,
                                params: dict[str, Any]) -> Any | None:
    """Supply the kernel for a quantization method on this platform.

    Called once per quantization method when the model is built. `method` is the method's
    kernel name (e.g. "int8", "int4", "fp8", "gguf"); `params` describes the layout (bits, group
    size, dtypes). Default: `platform.quantization_kernel(method, params)`. Returns a kernel
    object as documented by that method in `runtime.quantization`, or None to fall back to the
    method's portable reference kernel. First non-None answer wins.
    """


@hookspec(firstresult=True)
def runtime_custom_op(platform: Platform, name: str) -> Callable | None:
    """Replace a named layer op.

    Called once per op name per worker, when the model's layers are built (a draft model takes
    the same answers). The names and signatures (the
    portable implementations, which a replacement must match, are in `runtime.plugins.ops`):

    - "rms_norm": (x, weight, eps) -> normed x
    - "add_rms_norm": (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    - "silu_and_mul": (x) -> silu(x[..., :d]) * x[..., d:]
    - "rotary_embedding": (positions, query, key, cos_sin_cache, head_size) -> (query, key)
      rotated; query/key are [T, heads * head_size] and may be rotated in place
    - "linear": (weight) -> fn(x, bias) computing F.linear(x, weight, bias); called once per
      dense (unquantized) layer and the LM head after loading, so it may pre-pack the weight
    - "fused_moe": the experts of a mixture-of-experts layer (see `runtime.plugins.ops`)
    - "gelu_tanh_and_mul": (x) -> gelu_tanh(x[..., :d]) * x[..., d:] (Gemma's MLP)
    - "gelu": (x) -> F.gelu(x) (erf form; BERT's MLP), and "add_layer_norm": (x, residual,
      weight, bias, eps) -> F.layer_norm(x + residual, ...) (BERT's output blocks)
    - "gated_rms_norm": (x, gate, weight, eps, group_size, norm_before_gate) -> x [T, D]
      normed over each group of channels and gated by silu(gate), the recurrent layers' output
      norm (portable version and its rounding in `runtime.plugins.ops`)
    - "lora_shrink": (x, a, batch) -> [slices, T, rank], and "lora_expand": (y, buf, b, batch,
      offsets) -> y with each token's LoRA delta added in place: the two halves of multi-LoRA,
      per token slot (portable versions and `LoRABatch` in `runtime.plugins.lora_ops`)
    - the recurrent layers' ops, "causal_conv1d", "causal_conv1d_update", "selective_scan",
      "selective_state_update", "mamba2_chunk_scan", "mamba2_state_update",
      "chunk_gated_delta_rule" and "fused_recurrent_gated_delta_rule" (portable versions and
      their contracts in `runtime.plugins.recurrent_ops`); Kimi delta attention's "chunk_kda"
      and "fused_recurrent_kda" (in `runtime.plugins.kda_ops`)
    - "greedy_argmax": (x [rows, n] float32) -> each row's first maximum's index (int64, NaN
      above all), as x.max(dim=-1).indices; the sampler's greedy rows and exponential race

    Each name is asked for on its own, so a plugin may replace one and keep the others. A
    composite op ("add_rms_norm") is taken only from an implementation asked no later than the
    one answering the op it is built from; otherwise the engine composes it from that op, so
    replacing "rms_norm" alone changes every norm. Default: `platform.custom_op(name)`.
    Returns a callable with that signature, or None to keep the portable one. First non-None
    answer wins.
    """


@hookspec
def runtime_register_models() -> dict[str, Any]:
    """Add model architectures.

    Called each time the model registry is consulted: whenever a model's implementation is
    chosen (every engine, core process and draft model resolving its model), when the
    supported architectures are listed, and by `runtime plugins`; so an answer must be cheap
    and the same every time. Returns a dict that maps a Hugging Face architecture name
    (config.json's `architectures[0]`) to a model class, or to a string
    "package.module:ClassName" imported only when that architecture is loaded. All answers are
    collected; a plugin's entry replaces a built-in one of the same name.
    """


@hookspec
def runtime_register_kv_connectors() -> dict[str, Any]:
    """Add KV connectors (`runtime.plugins.kv_connector`).

    Called when an engine core or a worker builds the connector that `--kv-transfer-config`
    names, and by `runtime plugins`. Returns a dict that maps a connector name (the config's
    `kv_connector`) to a `KVConnectorClasses` (its scheduler and worker sides). All answers are
    collected; a plugin's entry replaces a built-in one of the same name.
    """


@hookspec
def runtime_logits_processors() -> list[Callable] | None:
    """Add logits processors to sampling.

    Called once per worker, when its model runner is built. A processor is a callable
    `(logits, batch) -> logits`: `logits` is the step's float32 [rows, vocab] tensor on the
    device, `batch` the step's `runtime.sampling.SamplingBatch`, one row per sampled position
    (k + 1 rows for a request verifying k proposals). Processors run after the engine's own
    adjustments (grammar mask, allowed_token_ids, bad_words, min_tokens, logit_bias,
    penalties) and before temperature, top-k/top-p/min-p and the draw, for greedy and random
    rows alike; they return a new tensor or modify `logits` in place. Returns a list of
    processors, or None. All answers are collected and run in the order they were collected.
    """
