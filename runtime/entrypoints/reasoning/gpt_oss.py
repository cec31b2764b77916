"""gpt-oss: the harmony format. An output is messages on channels,
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`, as
vLLM reads it: the analysis channel is the reasoning, the final channel the content. The
markers are special tokens, so requests under this parser keep special tokens in their text
(`skip_special_tokens` false) for the reader to find them; the reader drops the framing.

Text before any channel header is content (an output that is not harmony stays readable).
Other channels (commentary: preambles and tool calls) are neither reasoning nor content:
harmony tool calls are not parsed here."""
from __future__ import annotations

import re
from typing import Any

from runtime.entrypoints.reasoning.base import (ReasoningParser, Split, partial_suffix,
                                                 refuse_grammar)
from runtime.sampling_params import SamplingParams

# a message's header: `<|start|>assistant` (optional), the channel, a recipient or a
# `<|constrain|>` type maybe, then `<|message|>`
HEADER = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>(\w+)(?:(?!<\|message\|>).)*"
                    r"<\|message\|>", re.DOTALL)
END = re.compile(r"<\|(?:end|return|call)\|>")
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


class HarmonyReader:
    """A `ReasoningReader` for harmony: the same `feed` and `read`, the same result however
    the text is cut into deltas (a header or marker still arriving is held back)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = Split()

    def feed(self, text: str, final: bool = False) -> Split:
        self.text += text
        whole = _split(self.text, final)
        delta = Split(whole.reasoning[len(self.sent.reasoning):],
                      whole.content[len(self.sent.content):])
        self.sent = whole
        return delta

    def read(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and content, each None when there is none."""
        split = self.feed(text, final=True)
        has_reasoning = "<|channel|>analysis" in self.text
        return (split.reasoning if has_reasoning else None), (split.content or None)


def _split(text: str, final: bool) -> Split:
    split, pos, channel = Split(), 0, None
    while True:
        if channel is None:
            header = HEADER.search(text, pos)
            if pos == 0:  # before the first header: content
                before = text[:header.start()] if header else text
                split.content += before if header or final else _complete(before, True)
            if header is None:
                return split
            channel, pos = header.group(1), header.end()
        else:
            end = END.search(text, pos)
            body = text[pos:end.start()] if end else text[pos:]
            if end is None and not final:
                body = _complete(body, False)
            if channel == "analysis":
                split.reasoning += body
            elif channel == "final":
                split.content += body
            if end is None:
                return split
            channel, pos = None, end.end()


def _complete(text: str, headers: bool) -> str:
    """`text` less an end that may still become a marker (or, with `headers`, a header)."""
    cut = len(text) - partial_suffix(text, MARKERS)
    if headers:
        for opening in ("<|start|>", "<|channel|>"):
            found = text.find(opening)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


class GptOssReasoningParser(ReasoningParser):
    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        missing = [m for m in ("<|channel|>", "<|message|>", "<|end|>") if m not in vocab]
        if missing:
            raise ValueError(f"this reasoning parser reads gpt-oss's harmony format, but the "
                             f"tokenizer has no token {' or '.join(missing)}")

    @classmethod
    def reader(cls) -> HarmonyReader:
        return HarmonyReader()

    def request_params(self, params: SamplingParams) -> SamplingParams:
        params = refuse_grammar(params, "openai_gptoss", "its reasoning ends with a channel header "
                                "of several tokens")
        return params.clone(skip_special_tokens=False)
