"""The one selection routine for platforms and attention backends: forced → usable → highest
priority → a verdict for every candidate.

A forced name keeps only the candidates of that name; the usable ones among them are ranked by
priority; the first wins. Platforms refuse a tie at the top (two devices of equal claim are
ambiguous); backends take the earlier-listed one (a platform lists its own in its order).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Verdict:
    candidate: Any  # a PlatformCandidate or a BackendCandidate
    chosen: bool = False
    why: str = ""


@dataclass
class Choice:
    """Every candidate's verdict, best first; `problem` says why none won, if so: "unknown"
    (no candidate has the forced name), "unusable" (none of those left can run) or
    "ambiguous" (a tie at the top); `tied` holds the tied verdicts then."""

    verdicts: list[Verdict]
    problem: str | None = None
    tied: list[Verdict] | None = None

    @property
    def winner(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.chosen), None)


def choose(candidates: Sequence[Any], usable: Callable[[Any], bool], forced: str | None,
           how: str, among: str, unusable_as: str, ties_are_ambiguous: bool,
           order: Callable[[int, Any], Any]) -> Choice:
    """Rank `candidates` (each with `name`, `priority`, `reason`) by `order(index, c)`.

    `how` names the forcing flag in the verdicts ("--device cuda"); `among` the kind in the
    winner's ("candidates", "backends"); `unusable_as` prefixes an unusable one's reason
    ("not detected", "unusable").
    """
    indexed = sorted(enumerate(candidates), key=lambda ic: order(*ic))
    verdicts = [Verdict(c) for _, c in indexed]
    pool = verdicts
    if forced:
        pool = [v for v in verdicts if v.candidate.name == forced]
        for v in verdicts:
            if v.candidate.name != forced:
                v.why = f"not the forced one ({how})"
        if not pool:
            return Choice(verdicts, "unknown")
    ready = []
    for v in pool:
        if usable(v.candidate):
            ready.append(v)
        else:
            v.why = f"{unusable_as}: {v.candidate.reason or 'no reason given'}"
    if not ready:
        return Choice(verdicts, "unusable")
    top = ready[0].candidate.priority
    best = [v for v in ready if v.candidate.priority == top]
    if ties_are_ambiguous and len(best) > 1:
        for v in best:
            v.why = f"tied at the top priority {top}"
        for v in ready[len(best):]:
            v.why = f"lower priority ({v.candidate.priority} < {top})"
        return Choice(verdicts, "ambiguous", best)
    winner = ready[0]
    winner.chosen = True
    winner.why = f"forced ({how})" if forced else f"highest priority ({top}) among usable {among}"
    for v in ready[1:]:
        v.why = (f"lower priority ({v.candidate.priority} < {top})" if v.candidate.priority < top
                 else f"listed after {winner.candidate.name} at the same priority")
    return Choice(verdicts)
