"""Qwen3: `<think>...</think>` written by the model; with `enable_thinking: false` (a
`chat_template_kwargs` variable) the template closes an empty thinking in the prompt and the
output, holding no `<think>`, is all content."""
from __future__ import annotations

from runtime.entrypoints.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    implied_start = False
