"""The plugin manager: built-in platforms plus every entry point of group `runtime.plugins`.

Loading is forgiving on purpose: a plugin that fails to import, targets another hook API version
or implements a hook that does not exist is left out and recorded with the reason, so one broken
wheel never stops the engine; `runtime plugins` shows the records.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from runtime.plugins import hookspecs, platform_answers
from runtime.plugins.hookspecs import ENTRY_POINT_GROUP, HOOK_API_VERSION, PROJECT

logger = logging.getLogger(__name__)

# One line per built-in platform; the plugin's name is the module's last component ("cpu").
BUILTIN_PLUGINS = [
    "runtime.platforms.cpu",
    "runtime.platforms.cuda",
    "runtime.platforms.rocm",
    "runtime.platforms.xpu",
    "runtime.platforms.tpu",
]

PLUGINS_ENV = "RUNTIME_PLUGINS"


@dataclass
class PluginRecord:
    """One discovered plugin and what became of it."""

    name: str
    source: str  # "builtin" or the distribution that declared the entry point
    loaded: bool
    reason: str = ""
    target: str = ""  # the module (or "module:attr") the plugin was loaded from


@dataclass
class Reply:
    """One hook implementation's reply during `recorded_replies`: its answer or its error."""

    hook: str
    impl: Any  # pluggy's HookImpl
    value: Any = None
    error: BaseException | None = None


_replies: ContextVar[list[Reply] | None] = ContextVar("runtime_hook_replies", default=None)
# Hooks whose failing implementation answers None (its error noted) so the others still answer:
# one plugin's broken detection must not hide the other platforms.
FORGIVING_HOOKS = frozenset({"runtime_detect_platforms"})


@contextmanager
def recorded_replies() -> Iterator[list[Reply]]:
    """Every hook implementation's reply during the block, in call order."""
    replies: list[Reply] = []
    token = _replies.set(replies)
    try:
        yield replies
    finally:
        _replies.reset(token)


def _record_replies(hook: str, impl: Any) -> None:
    function = impl.function

    @functools.wraps(function)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        replies = _replies.get()
        try:
            value = function(*args, **kwargs)
        except Exception as e:
            if replies is not None:
                replies.append(Reply(hook, impl, error=e))
            if hook in FORGIVING_HOOKS:
                logger.warning("plugin %s: %s raised %s: %s", impl.plugin_name, hook,
                               type(e).__name__, e)
                return None
            raise
        if replies is not None:
            replies.append(Reply(hook, impl, value))
        return value

    impl.function = recorded


class PluginManager(pluggy.PluginManager):
    """pluggy's manager; every implementation it registers notes its replies for
    `recorded_replies` (how `runtime.plugins.answers` names who answered, through pluggy's own
    call, hook wrappers included)."""

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        name = super().register(plugin, name)
        for caller in self.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not (impl.hookwrapper or impl.wrapper):
                    _record_replies(caller.name, impl)
        return name


_lock = threading.RLock()  # re-entrant: a plugin may ask for the manager while it is imported
_state: tuple[PluginManager, list[PluginRecord]] | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use."""
    return _load()[0]


def discovered_plugins() -> list[PluginRecord]:
    """Every plugin found (built-in and entry points), loaded or not, with the reason."""
    return list(_load()[1])


def reset_plugin_manager() -> None:
    """Forget the manager so the next call rediscovers plugins (tests, changed environment)."""
    global _state
    with _lock:
        _state = None


def allowed_plugin_names() -> set[str] | None:
    """The names RUNTIME_PLUGINS allows, or None when it is unset (everything loads)."""
    names = {n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()}
    return names or None


def _load() -> tuple[PluginManager, list[PluginRecord]]:
    global _state
    with _lock:
        if _state is None:
            _state = _build()
        return _state


def _build() -> tuple[PluginManager, list[PluginRecord]]:
    pm = PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(platform_answers, name=platform_answers.NAME)  # part of the contract, always on
    allowed = allowed_plugin_names()
    records = []
    for module in BUILTIN_PLUGINS:
        name = module.rsplit(".", 1)[-1]
        load = functools.partial(importlib.import_module, module)
        records.append(_register(pm, name, "builtin", module, load, allowed))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        source = ep.dist.name if ep.dist is not None else "unknown distribution"
        records.append(_register(pm, ep.name, source, ep.value, ep.load, allowed))
    if allowed is not None:
        found = {r.name for r in records}
        for name in sorted(allowed - found):
            records.append(PluginRecord(name, PLUGINS_ENV, False,
                                        f"named in {PLUGINS_ENV} but no such plugin is installed"))
    return pm, records


def _register(pm: PluginManager, name: str, source: str, target: str,
              load: Callable[[], Any], allowed: set[str] | None) -> PluginRecord:
    record = PluginRecord(name, source, False, target=target)
    if allowed is not None and name not in allowed:
        record.reason = f"excluded by {PLUGINS_ENV}"
        return record
    try:
        plugin = load()
    except Exception as e:  # any import-time failure of a plugin is reported, not fatal
        record.reason = f"import failed: {type(e).__name__}: {e}"
        logger.warning("plugin %s (%s) not loaded: %s", name, source, record.reason)
        return record
    version = getattr(plugin, "RUNTIME_HOOK_API_VERSION", HOOK_API_VERSION)
    if version != HOOK_API_VERSION:
        record.reason = (f"written for hook API version {version}, "
                         f"this runtime provides version {HOOK_API_VERSION}")
        return record
    try:
        pm.register(plugin, name=name)
    except Exception as e:  # pluggy: duplicate name, or a hookimpl whose arguments the spec lacks
        record.reason = f"registration failed: {type(e).__name__}: {e}"
        return record
    unknown = sorted(hc.name for hc in pm.get_hookcallers(plugin) or [] if not hc.has_spec())
    if unknown:
        pm.unregister(plugin)
        record.reason = (f"implements unknown hook(s) {', '.join(unknown)} "
                         f"(hook API version {HOOK_API_VERSION})")
        return record
    record.loaded = True
    return record
