"""Prometheus metrics of a serving engine: what `/metrics` shows."""
from __future__ import annotations

import time
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from runtime.engine.core_proc import CoreStats
from runtime.outputs import RequestMetrics
from runtime.core.spec_stats import SpecDecodeStats
from runtime.structured_output.stats import COMPILE_SECONDS_BUCKETS, empty_counts

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.5, 0.75, 1.0, 2.5)


class Metrics:
    """One registry per server, labelled with the served model name; implements the engine's
    `StatsListener`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.running = gauge("runtime:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("runtime:num_requests_waiting",
                             "Sequences waiting for a place in the running batch.")
        self.kv_usage = gauge("runtime:kv_cache_usage_perc",
                              "Share of KV-cache blocks in use (1 = full).")
        self.hit_rate = gauge("runtime:prefix_cache_hit_rate",
                              "Share of looked-up prompt tokens found in the prefix cache.")
        self.preemptions = counter("runtime:num_preemptions", "Sequences preempted so far.")
        self.prompt_tokens = counter("runtime:prompt_tokens", "Prompt tokens of added requests.")
        self.generation_tokens = counter("runtime:generation_tokens", "Generated tokens.")
        self.requests = Counter("runtime:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = counter("runtime:request_rejected",
                                "Requests refused because the waiting queue was full.")
        self.core_restarts = counter("runtime:engine_core_restarts",
                                     "Engine core processes started again after one died.")
        self.ttft = histogram("runtime:time_to_first_token_seconds",
                              "Arrival to first generated token.", LATENCY_BUCKETS)
        self.tpot = histogram("runtime:time_per_output_token_seconds",
                              "Mean time between generated tokens, per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("runtime:e2e_request_latency_seconds",
                             "Arrival to the last output.", LATENCY_BUCKETS)
        self.spec_drafts = counter("runtime:spec_decode_num_drafts",
                                   "Speculative steps of a request that verified proposals.")
        self.spec_draft_tokens = counter("runtime:spec_decode_num_draft_tokens",
                                         "Proposed tokens verified by the target model.")
        self.spec_accepted_tokens = counter("runtime:spec_decode_num_accepted_tokens",
                                            "Proposed tokens the target model accepted.")
        self.spec_acceptance_rate = gauge("runtime:spec_decode_acceptance_rate",
                                          "Accepted share of the proposed tokens so far.")
        self.spec_mean_accepted_length = gauge(
            "runtime:spec_decode_mean_accepted_length",
            "Tokens a speculative step emits per request: accepted proposals + 1.")
        self.grammar_compiles = counter("runtime:structured_output_grammar_compiles",
                                        "Grammars compiled for structured outputs.")
        self.grammar_compile_seconds = GrammarCompileTimes(model_name)
        self.registry.register(self.grammar_compile_seconds)
        self.grammar_cache_hits = counter("runtime:structured_output_grammar_cache_hits",
                                          "Constrained requests whose grammar was cached.")
        self.grammar_cache_misses = counter(
            "runtime:structured_output_grammar_cache_misses",
            "Constrained requests whose grammar was not cached (and so was compiled).")
        self.grammar_cache_hit_rate = gauge(
            "runtime:structured_output_grammar_cache_hit_rate",
            "Share of constrained requests whose grammar was cached.")
        self.model_name = model_name
        self._last = CoreStats(0, 0, 0, 0.0, 0.0, 0)

    def on_core_stats(self, stats: CoreStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        last, self._last = self._last, stats
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.spec_drafts.inc(max(0, stats.num_spec_drafts - last.num_spec_drafts))
        self.spec_draft_tokens.inc(max(0, stats.num_spec_draft_tokens
                                       - last.num_spec_draft_tokens))
        self.spec_accepted_tokens.inc(max(0, stats.num_spec_accepted_tokens
                                          - last.num_spec_accepted_tokens))
        spec = SpecDecodeStats(stats.num_spec_drafts, stats.num_spec_draft_tokens,
                               stats.num_spec_accepted_tokens)
        self.spec_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_accepted_length.set(spec.mean_accepted_length)
        self.grammar_compiles.inc(max(0, stats.num_grammar_compiles - last.num_grammar_compiles))
        self.grammar_compile_seconds.add(stats, last)
        self.grammar_cache_hits.inc(max(0, stats.num_grammar_cache_hits
                                        - last.num_grammar_cache_hits))
        self.grammar_cache_misses.inc(max(0, stats.num_grammar_cache_misses
                                          - last.num_grammar_cache_misses))
        looked_up = stats.num_grammar_compiles + stats.num_grammar_cache_hits
        if looked_up:
            self.grammar_cache_hit_rate.set(stats.num_grammar_cache_hits / looked_up)

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def on_request_rejected(self) -> None:
        self.rejected.inc()

    def on_core_restart(self) -> None:
        self.core_restarts.inc()

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics,
                            tokens_per_sample: float) -> None:
        end = metrics.finished_time or time.monotonic()
        self.requests.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(end - metrics.arrival_time)
        if metrics.first_token_time is None:
            return
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if tokens_per_sample > 1:
            self.tpot.observe((end - metrics.first_token_time) / (tokens_per_sample - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class GrammarCompileTimes:
    """The histogram runtime:structured_output_grammar_compile_seconds, from the engine cores'
    per-bucket compile counts (cumulative, so a restarted core adds only what is new)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counts = empty_counts()
        self.seconds = 0.0

    def add(self, stats: CoreStats, last: CoreStats) -> None:
        before = last.grammar_compile_counts or empty_counts()
        for i, (now, then) in enumerate(zip(stats.grammar_compile_counts, before)):
            self.counts[i] += max(0, now - then)
        self.seconds += max(0.0, stats.grammar_compile_seconds - last.grammar_compile_seconds)

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "runtime:structured_output_grammar_compile_seconds",
            "Time to compile a grammar (in the engine core's thread pool).",
            labels=["model_name"])
        cumulative = list(accumulate(self.counts))
        family.add_metric([self.model_name],
                          [(str(le), n) for le, n in zip(COMPILE_SECONDS_BUCKETS, cumulative)]
                          + [("+Inf", cumulative[-1])], sum_value=self.seconds)
        return [family]
