"""Which implementation of each named layer op a model is built with, and who supplied it."""
from __future__ import annotations

from typing import Callable

from runtime.plugins.interfaces import Platform
from runtime.plugins.ops import COMPOSITES
from runtime.plugins.selection import hook_answer, hook_answers


class CustomOps:
    """Answers `BuildContext.custom_op` for one platform through the `runtime_custom_op` hook.

    A composite op (add_rms_norm = add, then rms_norm) is taken from a plugin only when no
    plugin asked before it answers the op it is built from; otherwise it is None and the layer
    composes it from the registered part, so overriding `rms_norm` alone changes every norm
    call. `answered_by` records, per op, who answered (None: nobody, the portable op runs).
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.answered_by: dict[str, str | None] = {}

    def __call__(self, name: str) -> Callable | None:
        if name in COMPOSITES:
            op, who = self._composite(name, COMPOSITES[name][0])
        else:
            op, who = hook_answer("runtime_custom_op", platform=self.platform, name=name)
        self.answered_by[name] = who
        return op

    def _composite(self, name: str, part: str) -> tuple[Callable | None, str | None]:
        whole = hook_answers("runtime_custom_op", platform=self.platform, name=name)
        parts = hook_answers("runtime_custom_op", platform=self.platform, name=part)
        for (who, op), (_, part_op) in zip(whole, parts):
            if op is not None:
                return op, who
            if part_op is not None:
                return None, f"composed from {part} ({who})"
        return None, None
