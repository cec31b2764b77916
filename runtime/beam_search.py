"""Beam search with Hugging Face `generate`'s semantics (`num_beams`, `length_penalty`,
`early_stopping`), over any engine that returns the top logprobs of one next token.

`BeamSearch` is the search of one prompt as a state machine: `pending()` gives the sequences
whose next-token logprobs it needs, `advance()` takes them. `BeamSearchGroup` advances several
prompts' searches together; `LLM.beam_search` and the server's `use_beam_search` both drive one,
one engine step per generated token; the beams are ordinary requests, so they share the
prompt's KV blocks through the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from runtime.outputs import RequestOutput

EARLY_STOPPING = (True, False, "never")


@dataclass
class BeamSearchParams:
    """`early_stopping` as in transformers: True stops as soon as `beam_width` sequences have
    finished; False stops when the best running beam can no longer beat them, judged at its
    current length; "never" judges it at max_tokens when the length penalty favours length.
    A finished sequence scores cumulative logprob / (generated tokens ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.early_stopping not in EARLY_STOPPING or \
                (self.early_stopping != "never" and not isinstance(self.early_stopping, bool)):
            raise ValueError(f"early_stopping must be True, False or 'never', "
                             f"got {self.early_stopping!r}")
        if not isinstance(self.length_penalty, (int, float)) or \
                isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens (the end-of-sequence token included)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(tokens) ** length_penalty
    finish_reason: str  # "stop" (end of sequence) or "length"
    text: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, beam_width of them


@dataclass
class _Beam:
    tokens: list[int]
    logprob: float


@dataclass
class BeamSearch:
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: list[int]
    running: list[_Beam] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False
    _improvable: bool = True

    def __post_init__(self) -> None:
        self.running = [_Beam([], 0.0)]
        stops = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        # as transformers: enough candidates that beam_width survive even if the best all end
        self.num_candidates = max(2, 1 + stops) * self.params.beam_width
        if self.num_candidates > MAX_LOGPROBS:
            raise ValueError(f"beam_width {self.params.beam_width} needs the top "
                             f"{self.num_candidates} logprobs per step, more than the "
                             f"{MAX_LOGPROBS} the engine returns: use beam_width <= "
                             f"{MAX_LOGPROBS // max(2, 1 + stops)}")

    def step_params(self) -> SamplingParams:
        """What each pending sequence is run with: one token, and the top candidates' logprobs."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              logprobs=self.num_candidates, detokenize=False)

    def pending(self) -> list[list[int]]:
        """Prompt + tokens of each running beam, in order."""
        return [self.prompt_token_ids + b.tokens for b in self.running]

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        """Apply one step: `next_logprobs[i]` holds at least the `num_candidates` most likely
        next tokens of running beam i, with their logprobs."""
        p = self.params
        width, penalty = p.beam_width, p.length_penalty
        candidates = sorted(((beam.logprob + lp, i, token)
                             for i, (beam, top) in enumerate(zip(self.running, next_logprobs))
                             for token, lp in top.items()),
                            key=lambda c: c[0], reverse=True)[:self.num_candidates]
        length = len(self.running[0].tokens) + 1
        ends = [(token in self.eos_token_ids and not p.ignore_eos) or length >= p.max_tokens
                for _, _, token in candidates]
        full = len(self.finished) == width
        if self._improvable and not (full and p.early_stopping is True):
            # only the top beam_width candidates may finish; the rest are spares for running
            for rank, ((logprob, i, token), end) in enumerate(zip(candidates, ends)):
                if rank < width and end:
                    tokens = self.running[i].tokens + [token]
                    reason = "stop" if token in self.eos_token_ids and not p.ignore_eos \
                        else "length"
                    self.finished.append(BeamSearchSequence(tokens, logprob,
                                                            logprob / length ** penalty,
                                                            reason))
            self.finished.sort(key=lambda s: s.score, reverse=True)
            del self.finished[width:]
        self.running = [_Beam(self.running[i].tokens + [token], logprob)
                        for (logprob, i, token), end in zip(candidates, ends) if not end][:width]
        if self.running and len(self.finished) == width:
            best_length = p.max_tokens if p.early_stopping == "never" and penalty > 0 \
                else length
            best = self.running[0].logprob / best_length ** penalty
            self._improvable = best > self.finished[-1].score
        self.done = (not self._improvable or not self.running or all(ends) or
                     (len(self.finished) == width and p.early_stopping is True))

    def output(self) -> BeamSearchOutput:
        return BeamSearchOutput(list(self.finished))


class BeamSearchGroup:
    """Several prompts' searches advanced together: each step runs every running beam of every
    unfinished search as one batch of one-token requests (`pending`, with `step_params`), and
    `advance` hands each search the next-token logprobs of its own beams."""

    def __init__(self, searches: list[BeamSearch]) -> None:
        self.searches = searches
        self._live: list[BeamSearch] = []

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def pending(self) -> list[list[int]]:
        """Prompt + tokens of every running beam of every unfinished search, in order."""
        self._live = [s for s in self.searches if not s.done]
        return [seq for s in self._live for seq in s.pending()]

    def step_params(self) -> SamplingParams:
        return self._live[0].step_params()

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Apply one step: `outputs` answer `pending()`'s sequences, in the same order."""
        at = 0
        for search in self._live:
            n = len(search.running)
            search.advance([{token: lp.logprob for token, lp in o.outputs[0].logprobs[0].items()}
                            for o in outputs[at:at + n]])
            at += n
