"""Asking the hooks through pluggy (its wrappers and call order included) and knowing who
answered; and `PlatformAnswers`, the one record of what a worker was given.

The plugin manager wraps every hook implementation it registers: while a call made here runs,
each implementation's reply (its answer, or what it raised) is noted, so the answering plugin
is named without calling anything twice or walking the plugins by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from runtime.plugins import platform_answers
from runtime.plugins.interfaces import (Communicator, CommunicatorSpec, EagerRunner,
                                        GraphRunner, ModelInfo, Platform)
from runtime.plugins.manager import Reply, get_plugin_manager, recorded_replies
from runtime.plugins.ops import COMPOSITES

class HookAnswerError(Exception):
    """A plugin raised while answering a hook; the message names the plugin."""


def ask(hook: str, wrap_errors: bool = False, **kwargs: Any) -> tuple[Any, list[Reply]]:
    """Call `hook` through pluggy; its result and every implementation's reply, in call order.
    What a plugin raises goes on as it is (an engine's refusal keeps its type), or, with
    `wrap_errors`, as a HookAnswerError naming the plugin."""
    caller = getattr(get_plugin_manager().hook, hook)
    with recorded_replies() as replies:
        try:
            result = caller(**kwargs)
        except Exception as e:
            if not wrap_errors:
                raise
            failed = next((r for r in replies if r.error is e), None)
            who = label(failed.impl, kwargs) if failed is not None else "a hook wrapper"
            raise HookAnswerError(f"{who}: {e}") from e
    return result, [r for r in replies if r.hook == hook]


def hook_answer(hook: str, wrap_errors: bool = True, **kwargs: Any) -> tuple[Any, str | None]:
    """A firstresult hook's answer (what pluggy returns) and who gave it; (None, None) when
    nobody answers. A plugin that raises becomes a HookAnswerError naming it, unless
    `wrap_errors` is False."""
    answer, replies = ask(hook, wrap_errors, **kwargs)
    return answer, _answered_by(answer, replies, kwargs)


def collected(hook: str, **kwargs: Any) -> tuple[list[tuple[str, Any]], list[Reply]]:
    """A collecting hook's answers as pluggy returns them (in call order, a hook wrapper's
    changes included), each with who gave it; and the replies (errors of forgiven plugins)."""
    result, replies = ask(hook, **kwargs)
    by_answer = {id(r.value): label(r.impl, kwargs) for r in replies if r.value is not None}
    return [(by_answer.get(id(a), "a hook wrapper"), a) for a in result], replies


def label(impl: Any, kwargs: dict[str, Any]) -> str:
    """Who an implementation is: its plugin's name, or "<name> platform" for the hooks'
    default implementation, which returns the platform's own method's answer."""
    if impl.plugin_name == platform_answers.NAME and "platform" in kwargs:
        return f"{kwargs['platform'].name} platform"
    return impl.plugin_name


def _answered_by(answer: Any, replies: list[Reply], kwargs: dict[str, Any]) -> str | None:
    given = next((r for r in reversed(replies) if r.value is not None), None)
    if given is None:
        return None if answer is None else "a hook wrapper"
    who = label(given.impl, kwargs)
    return who if given.value is answer else f"{who}, changed by a hook wrapper"


def _call_order(hook: str) -> list[Any]:
    return list(reversed(getattr(get_plugin_manager().hook, hook).get_hookimpls()))


@dataclass
class HookRecord:
    """What one hook answered a worker, and who: shown by `runtime plugins`, the conformance
    report and the worker's start-up log."""

    hook: str
    about: str  # what was asked ("rms_norm", "ranks [0, 1]", the model ...); "" if one question
    answer: str
    answered_by: str | None  # None: nobody (the engine's portable default runs)


class PlatformAnswers:
    """Everything the hooks supply to one worker on `platform`, each asked once and recorded.

    The worker, its `BuildContext`, a draft model and `runtime plugins` take their attention
    backend, graph runner, custom ops, quantization kernels, communicators and logits
    processors from here; `records` says who answered each.
    """

    def __init__(self, platform: Platform, requested_backend: str | None = None) -> None:
        self.platform = platform
        self.requested_backend = requested_backend
        self.records: dict[tuple[str, str], HookRecord] = {}
        self._ops: dict[str, Callable | None] = {}

    def _record(self, hook: str, about: str, answer: str, who: str | None) -> None:
        self.records[hook, about] = HookRecord(hook, about, answer, who)

    def attention_backend(self, model: ModelInfo, about: str = "") -> type:
        """`runtime_attention_backend` for `model` (`about` tells a draft model's apart)."""
        backend, who = hook_answer("runtime_attention_backend", False, platform=self.platform,
                                   model=model, requested=self.requested_backend)
        if backend is None:
            raise RuntimeError(f"no plugin supplies an attention backend for platform "
                               f"{self.platform.name!r}")
        self._record("runtime_attention_backend", about, backend.name, who)
        return backend

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        runner, who = hook_answer("runtime_graph_runner", False, platform=self.platform,
                                  model=model, enforce_eager=enforce_eager)
        runner = runner or EagerRunner()
        self._record("runtime_graph_runner", "", runner.name, who)
        return runner

    def custom_op(self, name: str) -> Callable | None:
        """`runtime_custom_op` for `name`, asked once. A composite op (add_rms_norm = add, then
        rms_norm) is taken from an implementation only when none called before it answers the
        op it is built from; otherwise it is None and the layer composes it from that part, so
        overriding `rms_norm` alone changes every norm."""
        if name not in self._ops:
            op, who, at = self._op_answer(name)
            if name in COMPOSITES:
                part = COMPOSITES[name][0]
                part_op, part_who, part_at = self._op_answer(part)
                if part_op is not None and part_at < at:
                    op, who = None, f"composed from {part} ({part_who})"
            self._ops[name] = op
            answer = (("composed" if who else "portable") if op is None
                      else getattr(op, "__qualname__", type(op).__name__))
            self._record("runtime_custom_op", name, answer, who)
        return self._ops[name]

    def _op_answer(self, name: str) -> tuple[Callable | None, str | None, int]:
        """`runtime_custom_op` for `name`, who answered, and that implementation's place in
        the call order (past the end when nobody did)."""
        kwargs = {"platform": self.platform, "name": name}
        op, replies = ask("runtime_custom_op", **kwargs)
        order = _call_order("runtime_custom_op")
        given = next((r for r in reversed(replies) if r.value is not None), None)
        at = order.index(given.impl) if given is not None else len(order)
        return op, _answered_by(op, replies, kwargs), at

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        kernel, who = hook_answer("runtime_quantization_kernel", False, platform=self.platform,
                                  method=method, params=params)
        self._record("runtime_quantization_kernel", method,
                     getattr(kernel, "name", "reference") if kernel is not None else "reference",
                     who)
        return kernel

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        comm, who = hook_answer("runtime_communicator", False, platform=self.platform, spec=spec)
        if comm is None:
            raise RuntimeError(f"no plugin supplies a communicator for platform "
                               f"{self.platform.name!r}, needed for ranks {spec.ranks}")
        self._record("runtime_communicator", f"ranks {spec.ranks}", type(comm).__name__, who)
        return comm

    def logits_processors(self) -> list[Callable]:
        """Every plugin's `runtime_logits_processors`, flattened, in hook order."""
        answers, _ = collected("runtime_logits_processors")
        processors = [p for _, answer in answers for p in answer or ()]
        self._record("runtime_logits_processors", "",
                     ", ".join(getattr(p, "__qualname__", type(p).__name__) for p in processors)
                     or "none", ", ".join(who for who, answer in answers if answer) or None)
        return processors

    def registered_models(self) -> dict[str, Any]:
        """Every plugin's `runtime_register_models` answer, recorded per plugin."""
        models: dict[str, Any] = {}
        answers, _ = collected("runtime_register_models")
        for _, answer in answers:  # as the registry applies them: the last asked wins
            models.update(answer or {})
        self._record("runtime_register_models", "", ", ".join(sorted(models)) or "none",
                     ", ".join(who for who, answer in answers if answer) or None)
        return models

    def registered_kv_connectors(self) -> dict[str, Any]:
        """Every plugin's `runtime_register_kv_connectors` answer, recorded per plugin."""
        connectors: dict[str, Any] = {}
        answers, _ = collected("runtime_register_kv_connectors")
        for _, answer in answers:  # the last asked wins, as for models
            connectors.update(answer or {})
        self._record("runtime_register_kv_connectors", "",
                     ", ".join(sorted(connectors)) or "none",
                     ", ".join(who for who, answer in answers if answer) or None)
        return connectors

    def implementers(self, hook: str) -> str:
        """The implementations of `hook` in call order (for a hook not asked here)."""
        kwargs = {"platform": self.platform}
        return ", ".join(label(impl, kwargs) for impl in _call_order(hook)
                         if not (impl.hookwrapper or impl.wrapper))
