"""What generation returns to the user."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # (monotonic, in the core) for /metrics' queue time
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    n: int = 1  # the request's n and max_tokens, for /metrics
    max_tokens: int | None = None
    last_token_time: float | None = None
    # the gaps between a request's steps that produced tokens (vLLM's inter-token latency)
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = field(default=0)
    # what another instance needs to find this request's KV (a KV connector's producer side,
    # for a request with kv_transfer_params {"do_remote_decode": true}), as vLLM's
    kv_transfer_params: dict | None = None
