"""Platform and attention-backend selection: ask the plugins what can run here, then pick one.

Platform rules: a forced name (`device=`, else env RUNTIME_DEVICE) narrows the candidates to that
name; among the usable candidates the highest priority wins; a tie at the top is ambiguous.
Whenever no single platform comes out, `PlatformError` names every candidate and why it was passed
over. Attention backends follow the same rules within one platform (`choose_attention_backend`),
forced by `--attention-backend NAME`, and `AttentionBackendError` explains a failure likewise.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from runtime.plugins.answers import HookAnswerError, collected, hook_answer
from runtime.plugins.backend_choice import decide_attention_backend
from runtime.plugins.choice import Verdict, choose
from runtime.plugins.interfaces import ModelInfo, Platform, PlatformCandidate
from runtime.plugins.manager import PLUGINS_ENV, discovered_plugins

logger = logging.getLogger(__name__)

DEVICE_ENV = "RUNTIME_DEVICE"
INSTALL_HINT = ("install a platform, e.g. `pip install runtime[cpu]` (or [cuda], [rocm], [xpu], "
                f"[tpu]), or force one with --device NAME / {DEVICE_ENV}=NAME")


class PlatformError(ValueError):
    """No single platform could be chosen; the message says why, candidate by candidate."""


def detect_platforms() -> list[PlatformCandidate]:
    """Every plugin's `runtime_detect_platforms` answers, each tagged with its plugin's name.

    A plugin whose detection raises (pluggy's call goes on without it: the hook forgives its
    implementations) becomes an unusable candidate with the error as its reason, instead of
    breaking selection for everyone.
    """
    answers, replies = collected("runtime_detect_platforms")
    candidates = [PlatformCandidate(r.impl.plugin_name, None, plugin=r.impl.plugin_name,
                                    reason=f"detection raised {type(r.error).__name__}: {r.error}")
                  for r in reversed(replies) if r.error is not None]
    for name, answer in reversed(answers):  # in registration order: built-ins first
        for c in answer or []:
            if not isinstance(c, PlatformCandidate):
                c = PlatformCandidate(name, None,
                                      reason=f"detection returned {c!r}, not a PlatformCandidate")
            candidates.append(c if c.plugin else replace(c, plugin=name))
    return candidates


def select_platform(device: str | None = None) -> Platform:
    """The platform to run on: `device` (else RUNTIME_DEVICE) if given, else the best detected.

    Raises PlatformError when the forced name is unknown or unusable, when nothing usable was
    detected, or when several usable platforms tie at the top priority.
    """
    verdicts, error = _decide(detect_platforms(), *_forced(device))
    if error:
        raise PlatformError(error)
    winner = next(v for v in verdicts if v.chosen)
    logger.info("platform %s (plugin %s): %s", winner.candidate.name, winner.candidate.plugin,
                winner.why)
    return winner.candidate.platform


def explain_platforms(device: str | None = None) -> list[dict[str, Any]]:
    """One row per candidate for `runtime plugins`: detected or not, priority, and why it is
    or is not the active platform. At most one row has `active` True (none on an error)."""
    verdicts, _ = _decide(detect_platforms(), *_forced(device))
    return [{"name": v.candidate.name, "plugin": v.candidate.plugin,
             "priority": v.candidate.priority, "detected": v.candidate.platform is not None,
             "reason": v.candidate.reason, "active": v.chosen, "why": v.why} for v in verdicts]


def _forced(device: str | None) -> tuple[str | None, str]:
    if device:
        return device, f"--device {device}"
    env = os.environ.get(DEVICE_ENV, "").strip()
    return (env, f"{DEVICE_ENV}={env}") if env else (None, "")


def _decide(candidates: list[PlatformCandidate], forced: str | None,
            how: str) -> tuple[list[Verdict], str | None]:
    """Give every candidate a verdict; returns the verdicts (best first) and an error, if any."""
    choice = choose(candidates, lambda c: c.platform is not None, forced, how, "candidates",
                    "not detected", ties_are_ambiguous=True,
                    order=lambda i, c: (-c.priority, c.name))
    verdicts = choice.verdicts
    if choice.problem == "unknown":
        names = ", ".join(sorted({v.candidate.name for v in verdicts})) or "none"
        return verdicts, _message(f"no platform named {forced!r} ({how}); available: {names}",
                                  verdicts, f"pick one of: {names}")
    if choice.problem == "unusable":
        if forced:
            return verdicts, _message(f"platform {forced!r} ({how}) is not usable here",
                                      verdicts, "pick another platform or fix the reason above")
        return verdicts, _message("no usable platform", verdicts, INSTALL_HINT)
    if choice.problem == "ambiguous":
        best, top = choice.tied, choice.tied[0].candidate.priority
        labels = ", ".join(f"{v.candidate.name} (plugin {v.candidate.plugin})" for v in best)
        names = {v.candidate.name for v in best}
        hint = (f"force one with --device NAME or {DEVICE_ENV}=NAME" if len(names) == len(best)
                else f"keep only one of these plugins with {PLUGINS_ENV}")
        return verdicts, _message(f"ambiguous platform: {labels} tie at priority {top}",
                                  verdicts, hint)
    return verdicts, None


def _message(headline: str, verdicts: list[Verdict], hint: str) -> str:
    lines = [f"{headline}.", "Platform candidates:"]
    lines += [f"  - {v.candidate.name} (plugin {v.candidate.plugin}, priority "
              f"{v.candidate.priority}): {v.why}" for v in verdicts] or ["  (none)"]
    skipped = [r for r in discovered_plugins() if not r.loaded]
    if skipped:
        lines.append("Plugins not loaded:")
        lines += [f"  - {r.name} ({r.source}): {r.reason}" for r in skipped]
    lines.append(f"To fix: {hint}.")
    return "\n".join(lines)


def explain_attention_backends(platform: Platform, model: ModelInfo,
                               requested: str | None = None) -> dict[str, Any]:
    """What `runtime_attention_backend` answers for `platform` and `model`, and why.

    Returns {"backends": rows, "chosen": name or None, "answered_by": plugin or None, "error":
    message or None}. The rows are every plugin's `runtime_attention_backend_candidates`, each
    with `usable`, `chosen` and `why`; the answer itself comes from the real firstresult hook,
    through pluggy, with the plugin that gave it (`runtime.plugins.answers.hook_answer`).
    """
    kwargs = {"platform": platform, "model": model, "requested": requested}
    candidates = []
    answers, _ = collected("runtime_attention_backend_candidates", platform=platform, model=model)
    for who, answer in answers:
        # a plugin's own label stays; the platform's own answer is tagged "<name> platform"
        default = who == f"{platform.name} platform"
        candidates += [c if c.plugin and not default else replace(c, plugin=who)
                       for c in answer or []]
    verdicts, _ = decide_attention_backend(candidates, requested, platform.name)
    answer, answered_by, error = None, None, None
    try:
        answer, answered_by = hook_answer("runtime_attention_backend", **kwargs)
    except HookAnswerError as e:  # the explanation must survive a plugin refusing the request
        error = str(e)
    rows = []
    for v in verdicts:
        c = v.candidate
        chosen = answer is not None and c.backend is answer and c.plugin == answered_by
        why = v.why
        if chosen and not v.chosen:
            why = f"chosen by {answered_by}"
        elif v.chosen and not chosen:
            why = (f"usable, but {answered_by} answered first with {answer.name}"
                   if answer is not None else "usable, but no plugin chose it")
        rows.append({"name": c.name, "plugin": c.plugin, "priority": c.priority,
                     "usable": c.backend is not None, "reason": c.reason, "chosen": chosen,
                     "why": why})
    if answer is not None and not any(r["chosen"] for r in rows):
        rows.insert(0, {"name": answer.name, "plugin": answered_by, "priority": None,
                        "usable": True, "reason": "", "chosen": True,
                        "why": f"answered runtime_attention_backend ({answered_by})"})
    return {"backends": rows, "chosen": answer.name if answer is not None else None,
            "answered_by": answered_by, "error": error}
