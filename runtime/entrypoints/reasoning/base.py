"""What the reasoning parsers share: the reasoning sits between a start and an end marker,
each one token of the vocabulary (`<think>` and `</think>` for most families), or, for a
family that writes phrases (Granite), one of a few texts."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.entrypoints.errors import bad_request
from runtime.sampling_params import SamplingParams

BEFORE, REASONING, CONTENT = "before", "reasoning", "content"


@dataclass
class Split:
    """A piece of output (a stream's delta, or a whole output) as reasoning and content."""

    reasoning: str = ""
    content: str = ""


class ReasoningReader:
    """Splits one output into reasoning and content as its text arrives, with the same result
    however the text is cut into deltas. Before the start marker the text is content, unless
    the family's reasoning starts without one (`implied_start`: the template opened it in the
    prompt); a start marker met before any end is dropped; after the end marker all is
    content. Text that may be the beginning of a marker is held back until the next delta, or
    the last (`final`). `start` and `end` are a marker each, or each a tuple of markers any
    of which counts."""

    def __init__(self, start: str | tuple[str, ...], end: str | tuple[str, ...],
                 implied_start: bool) -> None:
        self.starts = (start,) if isinstance(start, str) else start
        self.ends = (end,) if isinstance(end, str) else end
        self.state = REASONING if implied_start else BEFORE
        self.started = False  # a start marker was read
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> Split:
        split, text = Split(), self.pending + text
        self.pending = ""
        while text:
            if self.state == CONTENT:
                split.content += text
                break
            markers = list(self.ends) if self.state == REASONING else []
            if not self.started:
                markers += self.starts
            found = [(text.find(m), m) for m in markers if m in text]
            if not found:
                keep = 0 if final else partial_suffix(text, markers)
                self._add(split, text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                break
            at, marker = min(found)
            self._add(split, text[:at])
            text = text[at + len(marker):]
            if marker in self.ends and self.state == REASONING:
                self.state = CONTENT
            else:
                self.started, self.state = True, REASONING
        return split

    def read(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and content, each None when there is none (vLLM's
        non-streaming answer; a reader is used once)."""
        split = self.feed(text, final=True)
        has_reasoning = self.started or self.state != BEFORE
        return (split.reasoning if has_reasoning else None), (split.content or None)

    def _add(self, split: Split, text: str) -> None:
        if self.state == REASONING:
            split.reasoning += text
        else:
            split.content += text


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningParser:
    """A model family's reasoning markers, resolved to token ids in the served tokenizer."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether reasoning starts at the output's first token without a start marker.
    implied_start: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        missing = [m for m in (self.start, self.end) if m not in vocab]
        if missing:
            raise ValueError(f"this reasoning parser reads {self.start}...{self.end}, but the "
                             f"tokenizer has no token {' or '.join(missing)}")
        self.start_token_id: int = vocab[self.start]
        self.end_token_id: int = vocab[self.end]

    @classmethod
    def reader(cls) -> ReasoningReader:
        """A reader for one output (one per sample)."""
        return ReasoningReader(cls.start, cls.end, cls.implied_start)

    def request_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as a request read by this parser runs: its grammar (structured outputs, a
        forced tool call) starts after the reasoning, as vLLM applies it; unconstrained params
        as they are."""
        if params.structured_outputs is None:
            return params
        return params.clone(_reasoning_token_ids=(self.start_token_id, self.end_token_id))


def refuse_grammar(params: SamplingParams, parser: str, why: str) -> SamplingParams:
    """`params` unchanged when they hold no grammar; a 400 naming the parser when they do (its
    end of reasoning is no single token, at which the grammar could start)."""
    if params.structured_outputs is not None:
        raise bad_request(f"structured outputs (response_format, a required or named tool "
                         f"choice) are not supported with --reasoning-parser {parser}: {why}, "
                         "so the grammar cannot be held until the reasoning ends")
    return params
