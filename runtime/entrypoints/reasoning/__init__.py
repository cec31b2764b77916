"""Reasoning in model output (`--reasoning-parser`): one parser per model family's markers,
readers that split an output into its reasoning and its content while it streams, and the
markers' token ids the engine needs to start a grammar only once the reasoning has ended."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.reasoning.base import ReasoningParser, ReasoningReader
from runtime.entrypoints.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from runtime.entrypoints.reasoning.gpt_oss import GptOssReasoningParser
from runtime.entrypoints.reasoning.granite import GraniteReasoningParser
from runtime.entrypoints.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "granite": GraniteReasoningParser,
    "openai_gptoss": GptOssReasoningParser,  # vLLM's name for it
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_of(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    """The `--reasoning-parser` named `name` for this tokenizer (None: none); a ValueError when
    the name is unknown or the tokenizer lacks the family's markers as single tokens."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown --reasoning-parser {name!r}; known: "
                         f"{', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](tokenizer)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningReader", "reasoning_parser_of"]
