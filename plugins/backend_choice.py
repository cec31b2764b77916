"""Choosing one attention backend among a platform's candidates, and explaining the choice.

The rules are the platform rules (`runtime.plugins.choice`, one routine for both) within one
platform: a forced name (`--attention-backend NAME`) keeps only candidates of that name; among
the usable ones the highest priority wins, the earlier-listed one on a tie; when none can serve,
`AttentionBackendError` lists every candidate and why it was passed over.
"""
from __future__ import annotations

import logging
from runtime.plugins.choice import Verdict, choose
from runtime.plugins.interfaces import BackendCandidate

logger = logging.getLogger(__name__)


class AttentionBackendError(ValueError):
    """No attention backend can serve the request; the message lists every candidate and why."""


def decide_attention_backend(candidates: list[BackendCandidate], requested: str | None,
                             platform: str) -> tuple[list[Verdict], str | None]:
    """Give every backend candidate a verdict (best first); returns them and an error, if any.

    `requested` (the user's `--attention-backend`) keeps only candidates of that name; among the
    usable ones the highest priority wins, the earlier-listed one on a tie.
    """
    how = f"--attention-backend {requested}"
    choice = choose(candidates, lambda c: c.backend is not None, requested, how, "backends",
                    "unusable", ties_are_ambiguous=False, order=lambda i, c: (-c.priority, i))
    verdicts = choice.verdicts
    if choice.problem == "unknown":
        known = ", ".join(sorted({c.name for c in candidates})) or "none"
        return verdicts, _backend_message(
            f"attention backend {requested!r} ({how}) is not offered on platform "
            f"{platform!r}; known: {known}", verdicts)
    if choice.problem == "unusable":
        headline = (f"attention backend {requested!r} ({how}) cannot run here" if requested
                    else f"no attention backend can run on platform {platform!r}")
        return verdicts, _backend_message(headline, verdicts)
    for v in verdicts:  # a usable one's reason is the platform's note on why it ranked it so
        if v.candidate.backend is not None and v.candidate.reason and (
                not requested or v.candidate.name == requested):
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


def _backend_message(headline: str, verdicts: list[Verdict]) -> str:
    lines = [f"{headline}.", "Attention backends considered:"]
    lines += [f"  - {v.candidate.name} (plugin {v.candidate.plugin or '?'}, priority "
              f"{v.candidate.priority}): {v.why}" for v in verdicts] or ["  (none)"]
    return "\n".join(lines)
