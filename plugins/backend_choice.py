"""Choosing one attention backend among a platform's candidates, and explaining the choice.

The rules are the platform rules of `runtime.plugins.selection` within one platform: a forced
name (`--attention-backend NAME`) keeps only candidates of that name; among the usable ones the
highest priority wins, the earlier-listed one on a tie; when none can serve,
`AttentionBackendError` lists every candidate and why it was passed over.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from runtime.plugins.interfaces import BackendCandidate

logger = logging.getLogger(__name__)


class AttentionBackendError(ValueError):
    """No attention backend can serve the request; the message lists every candidate and why."""


@dataclass
class BackendVerdict:
    candidate: BackendCandidate
    chosen: bool = False
    why: str = ""


def decide_attention_backend(candidates: list[BackendCandidate], requested: str | None,
                             platform: str) -> tuple[list[BackendVerdict], str | None]:
    """Give every backend candidate a verdict (best first); returns them and an error, if any.

    `requested` (the user's `--attention-backend`) keeps only candidates of that name; among the
    usable ones the highest priority wins, the earlier-listed one on a tie.
    """
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i].priority, i))
    verdicts = [BackendVerdict(candidates[i]) for i in order]
    known = ", ".join(sorted({c.name for c in candidates})) or "none"
    how = f"--attention-backend {requested}"
    pool = verdicts
    if requested:
        pool = [v for v in verdicts if v.candidate.name == requested]
        for v in verdicts:
            if v.candidate.name != requested:
                v.why = f"not the forced one ({how})"
        if not pool:
            return verdicts, _backend_message(
                f"attention backend {requested!r} ({how}) is not offered on platform "
                f"{platform!r}; known: {known}", verdicts)
    usable = []
    for v in pool:
        if v.candidate.backend is None:
            v.why = f"unusable: {v.candidate.reason or 'no reason given'}"
        else:
            usable.append(v)
    if not usable:
        headline = (f"attention backend {requested!r} ({how}) cannot run here" if requested
                    else f"no attention backend can run on platform {platform!r}")
        return verdicts, _backend_message(headline, verdicts)
    winner = usable[0]
    winner.chosen = True
    winner.why = (f"forced ({how})" if requested
                  else f"highest priority ({winner.candidate.priority}) among usable backends")
    for v in usable[1:]:
        v.why = (f"lower priority ({v.candidate.priority} < {winner.candidate.priority})"
                 if v.candidate.priority < winner.candidate.priority
                 else f"listed after {winner.candidate.name} at the same priority")
    for v in usable:
        if v.candidate.reason:  # the platform's note on why it ranked this backend so
            v.why += f": {v.candidate.reason}"
    return verdicts, None


def choose_attention_backend(candidates: list[BackendCandidate], requested: str | None,
                             platform: str) -> type:
    """The backend class `decide_attention_backend` picks; raises AttentionBackendError if none."""
    verdicts, error = decide_attention_backend(candidates, requested, platform)
    if error:
        raise AttentionBackendError(error)
    winner = next(v for v in verdicts if v.chosen)
    logger.info("attention backend %s: %s", winner.candidate.name, winner.why)
    return winner.candidate.backend


def _backend_message(headline: str, verdicts: list[BackendVerdict]) -> str:
    lines = [f"{headline}.", "Attention backends considered:"]
    lines += [f"  - {v.candidate.name} (plugin {v.candidate.plugin or '?'}, priority "
              f"{v.candidate.priority}): {v.why}" for v in verdicts] or ["  (none)"]
    return "\n".join(lines)
