"""Tokens per engine step as histogram counts: what the engine core reports for vLLM's
`vllm:iteration_tokens_total` (no prometheus_client here, so the core can import it)."""
from __future__ import annotations

from bisect import bisect_left

# upper bounds (tokens, inclusive) of vllm:iteration_tokens_total, as vLLM's
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokens:
    """Cumulative: steps per bucket (one more for above the last bound) and tokens in all."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.total = 0

    def add(self, num_tokens: int) -> None:
        self.counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.total += num_tokens
