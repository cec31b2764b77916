"""What crosses from the engine to the workers each step, and back. Plain data, picklable."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0] (= computed tokens before the step)
    block_ids: list[int]
    sample: bool  # the step reaches the end of the known tokens, so a token is sampled
    params: SamplingParams
    sample_index: int
    num_prompt_tokens: int
    all_token_ids: list[int]  # prompt + output so far (read for penalties and prompt logprobs)
    # proposed tokens to verify: the tail of token_ids, past all_token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0  # slots reserved past token_ids (a draft model writes its KV there)


@dataclass
class StepInput:
    requests: list[ScheduledRequest]
    finished_ids: list[str] = field(default_factory=list)  # the worker may drop their state


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled or prompt position: ids[0] is the chosen token."""

    ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class StepOutput:
    # accepted proposals, then the target's own token
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (position of the first entry, one entry per prompt position predicted)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for next step
