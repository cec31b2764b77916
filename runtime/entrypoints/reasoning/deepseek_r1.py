"""DeepSeek R1 (and its distills): `<think>...</think>`, the template opens the thinking in the
prompt, so an output is reasoning until `</think>` even without a `<think>` of its own."""
from __future__ import annotations

from runtime.entrypoints.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    implied_start = True
