"""Grammar compile times as histogram counts: what the engine core reports and `/metrics`
exposes (no xgrammar here, so the API process can import it)."""
from __future__ import annotations

from bisect import bisect_left

# upper bounds (seconds, inclusive) of runtime:structured_output_grammar_compile_seconds
COMPILE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def add_compile_time(counts: list[int], seconds: float) -> None:
    """Count one compile in `counts` (one per bucket, then one for above the last bound)."""
    counts[bisect_left(COMPILE_SECONDS_BUCKETS, seconds)] += 1


def empty_counts() -> list[int]:
    return [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)
