"""The periodic stats line of a serving engine (vLLM's "Avg prompt throughput ..." log), unless
`--disable-log-stats`. It wraps the server's other `StatsListener` (the Prometheus metrics)."""
from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("runtime.stats")


class StatLogger:
    """Forwards every event to `inner` and logs throughput, batch and KV-cache usage at most
    once per `interval` seconds, and only after tokens moved."""

    def __init__(self, inner: Any, interval: float = 10.0) -> None:
        self.inner = inner
        self.interval = interval
        self.last = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def on_core_stats(self, stats: Any) -> None:
        self.inner.on_core_stats(stats)
        now = time.monotonic()
        elapsed = now - self.last
        if elapsed < self.interval or not (self.prompt_tokens or self.generation_tokens):
            return
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", self.prompt_tokens / elapsed,
                    self.generation_tokens / elapsed, stats.num_running, stats.num_waiting,
                    100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate)
        self.last, self.prompt_tokens, self.generation_tokens = now, 0, 0

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.inner.on_request_added(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self.generation_tokens += num_tokens
        self.inner.on_tokens(num_tokens)

    def on_request_finished(self, *args: Any) -> None:
        self.inner.on_request_finished(*args)

    def on_core_restart(self) -> None:
        self.inner.on_core_restart()

    def on_sleep_state(self, asleep: set[str]) -> None:
        self.inner.on_sleep_state(asleep)
