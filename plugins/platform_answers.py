"""The hooks' default implementations: each returns what the chosen platform's own method says.

Registered by the plugin manager before every other plugin and marked `trylast`, so any plugin's
implementation of the same hook is asked first (a `tryfirst` one before all others); the engine
always asks the hook, never the platform method directly, so an override takes effect everywhere.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from runtime.plugins.backend_choice import choose_attention_backend
from runtime.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from runtime.attention_backends.base import AttentionBackend
    from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                            GraphRunner, ModelInfo, Platform)

NAME = "platform"  # the name this plugin is registered under


@hookimpl(trylast=True)
def runtime_attention_backend_candidates(platform: Platform,
                                         model: ModelInfo) -> list[BackendCandidate]:
    return platform.attention_backend_candidates(model)


@hookimpl(trylast=True)
def runtime_attention_backend(platform: Platform, model: ModelInfo,
                              requested: str | None) -> type[AttentionBackend]:
    """The platform's usable candidate of highest priority, or the one `requested` names."""
    return choose_attention_backend(platform.attention_backend_candidates(model), requested,
                                    platform.name)


@hookimpl(trylast=True)
def runtime_graph_runner(platform: Platform, model: ModelInfo,
                         enforce_eager: bool) -> GraphRunner:
    return platform.graph_runner(model, enforce_eager)


@hookimpl(trylast=True)
def runtime_communicator(platform: Platform, spec: CommunicatorSpec) -> Communicator | None:
    return platform.communicator(spec)


@hookimpl(trylast=True)
def runtime_quantization_kernel(platform: Platform, method: str, params: dict[str, Any]) -> Any:
    return platform.quantization_kernel(method, params)


@hookimpl(trylast=True)
def runtime_custom_op(platform: Platform, name: str) -> Callable | None:
    return platform.custom_op(name)
