"""IBM Granite (3.2 and later, with `thinking: true` in `chat_template_kwargs`): the model
writes "Here is my thought process:" before its reasoning and "Here is my response:" before
its answer, phrases rather than tokens ("Here's" is taken too, as vLLM does: quantized models
were seen writing it). Text before the first phrase is content."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.reasoning.base import ReasoningParser, ReasoningReader, refuse_grammar
from runtime.sampling_params import SamplingParams

STARTS = ("Here is my thought process:", "Here's my thought process:")
ENDS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    def __init__(self, tokenizer: Any) -> None:
        """Any tokenizer: the phrases are plain text."""

    @classmethod
    def reader(cls) -> ReasoningReader:
        return ReasoningReader(STARTS, ENDS, implied_start=False)

    def request_params(self, params: SamplingParams) -> SamplingParams:
        return refuse_grammar(params, "granite", "its reasoning ends with a phrase")
