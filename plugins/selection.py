"""Platform selection: ask every plugin which devices it can drive here, then pick one.

Rules: a forced name (`device=`, else env RUNTIME_DEVICE) narrows the candidates to that name;
among the usable candidates the highest priority wins; a tie at the top is ambiguous. Whenever no
single platform comes out, `PlatformError` names every candidate and why it was passed over.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from plugins.interfaces import Platform, PlatformCandidate
from plugins.manager import PLUGINS_ENV, discovered_plugins, get_plugin_manager

logger = logging.getLogger(__name__)

DEVICE_ENV = "RUNTIME_DEVICE"
INSTALL_HINT = ("install a platform, e.g. `pip install runtime[cpu]` (or [cuda], [rocm], [xpu], "
                f"[tpu]), or force one with --device NAME / {DEVICE_ENV}=NAME")


class PlatformError(ValueError):
    """No single platform could be chosen; the message says why, candidate by candidate."""


@dataclass
class _Verdict:
    candidate: PlatformCandidate
    active: bool = False
    why: str = ""


def detect_platforms() -> list[PlatformCandidate]:
    """Every plugin's `runtime_detect_platforms` answers, each tagged with its plugin's name.

    Plugins are asked one by one so that a plugin whose detection raises becomes an unusable
    candidate with the error as its reason instead of breaking selection for everyone.
    """
    candidates = []
    for impl in get_plugin_manager().hook.runtime_detect_platforms.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            answers = impl.function() or []
        except Exception as e:  # a plugin's detection bug must not hide the other platforms
            answers = [PlatformCandidate(impl.plugin_name, None,
                                         reason=f"detection raised {type(e).__name__}: {e}")]
        for c in answers:
            if not isinstance(c, PlatformCandidate):
                c = PlatformCandidate(impl.plugin_name, None,
                                      reason=f"detection returned {c!r}, not a PlatformCandidate")
            candidates.append(c if c.plugin else replace(c, plugin=impl.plugin_name))
    return candidates


def select_platform(device: str | None = None) -> Platform:
    """The platform to run on: `device` (else RUNTIME_DEVICE) if given, else the best detected.

    Raises PlatformError when the forced name is unknown or unusable, when nothing usable was
    detected, or when several usable platforms tie at the top priority.
    """
    verdicts, error = _decide(detect_platforms(), *_forced(device))
    if error:
        raise PlatformError(error)
    winner = next(v for v in verdicts if v.active)
    logger.info("platform %s (plugin %s): %s", winner.candidate.name, winner.candidate.plugin,
                winner.why)
    return winner.candidate.platform


def explain_platforms(device: str | None = None) -> list[dict[str, Any]]:
    """One row per candidate for `runtime plugins`: detected or not, priority, and why it is
    or is not the active platform. At most one row has `active` True (none on an error)."""
    verdicts, _ = _decide(detect_platforms(), *_forced(device))
    return [{"name": v.candidate.name, "plugin": v.candidate.plugin,
             "priority": v.candidate.priority, "detected": v.candidate.platform is not None,
             "reason": v.candidate.reason, "active": v.active, "why": v.why} for v in verdicts]


def _forced(device: str | None) -> tuple[str | None, str]:
    if device:
        return device, f"--device {device}"
    env = os.environ.get(DEVICE_ENV, "").strip()
    return (env, f"{DEVICE_ENV}={env}") if env else (None, "")


def _decide(candidates: list[PlatformCandidate], forced: str | None,
            how: str) -> tuple[list[_Verdict], str | None]:
    """Give every candidate a verdict; returns the verdicts (best first) and an error, if any."""
    verdicts = sorted((_Verdict(c) for c in candidates),
                      key=lambda v: (-v.candidate.priority, v.candidate.name))
    pool = verdicts
    if forced:
        pool = [v for v in verdicts if v.candidate.name == forced]
        for v in verdicts:
            if v.candidate.name != forced:
                v.why = f"not the forced one ({how})"
        if not pool:
            names = ", ".join(sorted({v.candidate.name for v in verdicts})) or "none"
            return verdicts, _message(f"no platform named {forced!r} ({how}); available: {names}",
                                      verdicts, f"pick one of: {names}")
    usable = []
    for v in pool:
        if v.candidate.platform is None:
            v.why = f"not detected: {v.candidate.reason or 'no reason given'}"
        else:
            usable.append(v)
    if not usable:
        if forced:
            return verdicts, _message(f"platform {forced!r} ({how}) is not usable here",
                                      verdicts, "pick another platform or fix the reason above")
        return verdicts, _message("no usable platform", verdicts, INSTALL_HINT)
    top = usable[0].candidate.priority
    best = [v for v in usable if v.candidate.priority == top]
    for v in usable[len(best):]:
        v.why = f"lower priority ({v.candidate.priority} < {top})"
    if len(best) > 1:
        for v in best:
            v.why = f"tied at the top priority {top}"
        labels = ", ".join(f"{v.candidate.name} (plugin {v.candidate.plugin})" for v in best)
        names = {v.candidate.name for v in best}
        hint = (f"force one with --device NAME or {DEVICE_ENV}=NAME" if len(names) == len(best)
                else f"keep only one of these plugins with {PLUGINS_ENV}")
        return verdicts, _message(f"ambiguous platform: {labels} tie at priority {top}",
                                  verdicts, hint)
    best[0].active = True
    best[0].why = (f"forced ({how})" if forced
                   else f"highest priority ({top}) among usable candidates")
    return verdicts, None


def _message(headline: str, verdicts: list[_Verdict], hint: str) -> str:
    lines = [f"{headline}.", "Platform candidates:"]
    lines += [f"  - {v.candidate.name} (plugin {v.candidate.plugin}, priority "
              f"{v.candidate.priority}): {v.why}" for v in verdicts] or ["  (none)"]
    skipped = [r for r in discovered_plugins() if not r.loaded]
    if skipped:
        lines.append("Plugins not loaded:")
        lines += [f"  - {r.name} ({r.source}): {r.reason}" for r in skipped]
    lines.append(f"To fix: {hint}.")
    return "\n".join(lines)
