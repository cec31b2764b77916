"""Prometheus metrics of a serving engine: what `/metrics` shows, under vLLM's names
(`vllm:*`, labels `model_name` and `engine`, vLLM's buckets), our own (`runtime:*`, label
`model_name`), or both (`--metrics-prefix`)."""
from __future__ import annotations

import time
from itertools import accumulate
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from runtime.config import EngineConfig
from runtime.engine.core_proc import CoreStats
from runtime.engine.step_stats import ITERATION_TOKENS_BUCKETS
from runtime.outputs import RequestMetrics
from runtime.core.spec_stats import SpecDecodeStats
from runtime.structured_output.checker import CheckCache
from runtime.structured_output.stats import COMPILE_SECONDS_BUCKETS

METRICS_PREFIXES = ("both", "vllm", "runtime")
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's names of the sleep states: awake, level 1 (weights_offloaded: on the CPU it frees the
# KV cache), level 2 (discard_all)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
ENGINE = "0"  # vLLM's `engine` label: with data parallelism, the replicas' totals

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Series:
    """One value served under each chosen prefix: every update goes to all of them."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)

    def set_function(self, value: Callable[[], float]) -> None:
        for c in self.children:
            c.set_function(value)


class Family:
    """A metric with further labels (such as `finished_reason`), under each served prefix."""

    def __init__(self, members: list[tuple[Any, dict[str, str]]]) -> None:
        self.members = members  # (the prometheus_client metric, its fixed labels)

    def labels(self, **extra: str) -> Series:
        return Series([metric.labels(**fixed, **extra) for metric, fixed in self.members])


class Metrics:
    """One registry per server; implements the engine's `StatsListener`. `prefix` is one of
    METRICS_PREFIXES. The token-count histograms and `vllm:cache_config_info` appear once
    `engine_started` has told the context length and the cache."""

    def __init__(self, model_name: str, prefix: str = "both") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, "
                             f"got {prefix!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.vllm = prefix in ("both", "vllm")
        self.runtime = prefix in ("both", "runtime")
        self.running = self._series(Gauge, "num_requests_running", "num_requests_running",
                                    "Sequences in the running batch.")
        self.waiting = self._series(Gauge, "num_requests_waiting", "num_requests_waiting",
                                    "Sequences waiting for a place in the running batch.")
        self.kv_usage = self._series(Gauge, "kv_cache_usage_perc", "kv_cache_usage_perc",
                                     "Share of KV-cache blocks in use (1 = full).")
        self.hit_rate = self._series(Gauge, None, "prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found in the prefix cache.")
        self.prefix_queries = self._series(Counter, "prefix_cache_queries", None,
                                           "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._series(Counter, "prefix_cache_hits", None,
                                        "Prompt tokens found in the prefix cache.")
        self.encoder_queries = self._series(
            Counter, None, "encoder_cache_queries",
            "Images a request needed for the first time (each a hit or one encoder run).")
        self.encoder_hits = self._series(
            Counter, None, "encoder_cache_hits",
            "Images found in the encoder cache (no encoder run).")
        self.preemptions = self._series(Counter, "num_preemptions", "num_preemptions",
                                        "Sequences preempted so far.")
        self.prompt_tokens = self._series(Counter, "prompt_tokens", "prompt_tokens",
                                          "Prompt tokens of added requests.")
        self.generation_tokens = self._series(Counter, "generation_tokens", "generation_tokens",
                                              "Generated tokens.")
        requests = self._family(Counter, "request_success", "request_success",
                                "Finished requests by finish reason.",
                                extra_labels=("finished_reason",))
        self.requests = {reason: requests.labels(finished_reason=reason)
                         for reason in FINISH_REASONS}
        sleep_state = self._family(Gauge, "engine_sleep_state", "engine_sleep_state",
                                   "Sleep mode: 1 for the state the engine is in, 0 for the "
                                   "others (see docs/sleep.md).", extra_labels=("sleep_state",))
        self.sleep_states = {s: sleep_state.labels(sleep_state=s) for s in SLEEP_STATES}
        self.on_sleep_state(set())
        self.rejected = self._series(Counter, None, "request_rejected",
                                     "Requests refused because the waiting queue was full.")
        self.core_restarts = self._series(Counter, None, "engine_core_restarts",
                                          "Engine core processes started again after one died.")
        self.ttft = self._series(Histogram, "time_to_first_token_seconds",
                                 "time_to_first_token_seconds",
                                 "Arrival to first generated token.", buckets=TTFT_BUCKETS)
        self.itl = self._series(Histogram, "inter_token_latency_seconds", None,
                                "Time between a request's steps that produced tokens.",
                                buckets=TOKEN_LATENCY_BUCKETS)
        self.tpot = self._series(Histogram, "request_time_per_output_token_seconds",
                                 "time_per_output_token_seconds",
                                 "Mean time between generated tokens, per request.",
                                 buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e = self._series(Histogram, "e2e_request_latency_seconds",
                                "e2e_request_latency_seconds", "Arrival to the last output.",
                                buckets=REQUEST_LATENCY_BUCKETS)
        self.queue_time = self._series(Histogram, "request_queue_time_seconds", None,
                                       "Arrival to first scheduled.",
                                       buckets=REQUEST_LATENCY_BUCKETS)
        self.inference_time = self._series(Histogram, "request_inference_time_seconds", None,
                                           "First scheduled to the last output.",
                                           buckets=REQUEST_LATENCY_BUCKETS)
        self.prefill_time = self._series(Histogram, "request_prefill_time_seconds", None,
                                         "First scheduled to the first generated token.",
                                         buckets=REQUEST_LATENCY_BUCKETS)
        self.decode_time = self._series(Histogram, "request_decode_time_seconds", None,
                                        "First generated token to the last output.",
                                        buckets=REQUEST_LATENCY_BUCKETS)
        self.spec_drafts = self._series(Counter, "spec_decode_num_drafts",
                                        "spec_decode_num_drafts",
                                        "Speculative steps of a request that verified proposals.")
        self.spec_draft_tokens = self._series(Counter, "spec_decode_num_draft_tokens",
                                              "spec_decode_num_draft_tokens",
                                              "Proposed tokens verified by the target model.")
        self.spec_accepted_tokens = self._series(Counter, "spec_decode_num_accepted_tokens",
                                                 "spec_decode_num_accepted_tokens",
                                                 "Proposed tokens the target model accepted.")
        self.spec_acceptance_rate = self._series(Gauge, None, "spec_decode_acceptance_rate",
                                                 "Accepted share of the proposed tokens so far.")
        self.spec_mean_accepted_length = self._series(
            Gauge, None, "spec_decode_mean_accepted_length",
            "Tokens a speculative step emits per request: accepted proposals + 1.")
        self.grammar_compiles = self._series(Counter, None, "structured_output_grammar_compiles",
                                             "Grammars compiled for structured outputs.")
        self.grammar_cache_hits = self._series(
            Counter, None, "structured_output_grammar_cache_hits",
            "Constrained requests whose grammar was cached.")
        self.grammar_cache_misses = self._series(
            Counter, None, "structured_output_grammar_cache_misses",
            "Constrained requests whose grammar was not cached (and so was compiled).")
        self.grammar_cache_hit_rate = self._series(
            Gauge, None, "structured_output_grammar_cache_hit_rate",
            "Share of constrained requests whose grammar was cached.")
        self.grammar_compile_seconds = CumulativeHistogram(
            "runtime:structured_output_grammar_compile_seconds",
            "Time to compile a grammar (in the engine core's thread pool).",
            {"model_name": model_name}, COMPILE_SECONDS_BUCKETS)
        self.iteration_tokens = CumulativeHistogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.",
            {"model_name": model_name, "engine": ENGINE}, ITERATION_TOKENS_BUCKETS)
        if self.runtime:
            self.registry.register(self.grammar_compile_seconds)
        if self.vllm:
            self.registry.register(self.iteration_tokens)
        self.params_n = self._series(Histogram, "request_params_n", None,
                                     "The n of finished requests.", buckets=(1, 2, 5, 10, 20))
        self.request_prompt_tokens: Series | None = None
        self.request_generation_tokens: Series | None = None
        self.params_max_tokens: Series | None = None
        self.lora_info: Gauge | None = None
        self.max_loras = 0
        self.grammar_check_cache_bytes = self._series(
            Gauge, None, "structured_output_check_cache_bytes",
            "Bytes held by the API process's cache of checked grammars (LRU, bounded by "
            "--grammar-cache-bytes).")
        self.kv_offload_hits = self._family(
            Counter, None, "kv_offload_hit_blocks",
            "Prefix-cache blocks loaded back from the offload tier, by level.",
            extra_labels=("tier",))
        self.kv_offload_blocks = self._family(
            Gauge, None, "kv_offload_blocks", "Blocks the offload tier holds, by level.",
            extra_labels=("tier",))
        self.kv_offload_saved = self._series(
            Counter, None, "kv_offload_saved_blocks",
            "Blocks evicted from the prefix cache and saved to the offload tier.")
        self.kv_offload_failed = self._series(
            Counter, None, "kv_offload_failed_loads",
            "Loads from the offload tier that failed (missing, truncated or corrupt files): "
            "those blocks were computed again.")
        self.kv_offload_bytes = self._family(
            Counter, None, "kv_offload_bytes", "Bytes moved by the offload tier, by direction.",
            extra_labels=("direction",))
        self.kv_offload_seconds = self._family(
            Counter, None, "kv_offload_seconds",
            "Time the workers spent moving offloaded blocks, by direction.",
            extra_labels=("direction",))
        self._last = CoreStats()

    def watch_grammar_checks(self, cache: CheckCache) -> None:
        """Report the size of the API process's cache of checked grammars."""
        self.grammar_check_cache_bytes.set_function(lambda: cache.bytes)

    def _series(self, kind: type, vllm_name: str | None, runtime_name: str | None, doc: str,
                buckets: tuple[float, ...] | list[int] | None = None) -> Series:
        """`kind` as `vllm:vllm_name` and `runtime:runtime_name`, as far as each prefix is
        served (a None name: not under that prefix)."""
        return self._family(kind, vllm_name, runtime_name, doc, buckets).labels()

    def _family(self, kind: type, vllm_name: str | None, runtime_name: str | None, doc: str,
                buckets: tuple[float, ...] | list[int] | None = None,
                extra_labels: tuple[str, ...] = ()) -> "Family":
        kwargs = {} if buckets is None else {"buckets": buckets}
        members = []
        for served, prefix, name, labels in (
                (self.vllm, "vllm", vllm_name, {"model_name": self.model_name, "engine": ENGINE}),
                (self.runtime, "runtime", runtime_name, {"model_name": self.model_name})):
            if served and name is not None:
                metric = kind(f"{prefix}:{name}", doc, [*labels, *extra_labels],
                              registry=self.registry, **kwargs)
                members.append((metric, labels))
        return Family(members)

    def engine_started(self, config: EngineConfig, max_model_len: int, num_blocks: int) -> None:
        """What is known once the engine is up: the token-count histograms' buckets (up to the
        context length) and vllm:cache_config_info."""
        buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = self._series(Histogram, "request_prompt_tokens", None,
                                                  "Prompt tokens per finished request.",
                                                  buckets=buckets)
        self.request_generation_tokens = self._series(
            Histogram, "request_generation_tokens", None,
            "Generated tokens per finished request (per sample).", buckets=buckets)
        self.params_max_tokens = self._series(Histogram, "request_params_max_tokens", None,
                                              "The max_tokens of finished requests that set "
                                              "it.", buckets=buckets)
        if self.vllm:
            info = {"engine": ENGINE, "block_size": str(config.block_size),
                    "cache_dtype": config.kv_cache_dtype,
                    "enable_prefix_caching": str(config.enable_prefix_caching),
                    "gpu_memory_utilization": str(config.gpu_memory_utilization),
                    "num_gpu_blocks": str(num_blocks)}
            Gauge("vllm:cache_config_info", "The KV cache's configuration.", list(info),
                  registry=self.registry).labels(**info).set(1)
            if config.enable_lora:
                self.max_loras = config.max_loras
                self.lora_info = Gauge(
                    "vllm:lora_requests_info", "The LoRA adapters of the running and the "
                    "waiting requests (comma-separated); the value is when they were seen.",
                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                    registry=self.registry)

    def on_core_stats(self, stats: CoreStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        if self.lora_info is not None:
            self.lora_info.labels(max_lora=str(self.max_loras),
                                  waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
                                  running_lora_adapters=",".join(stats.running_lora_adapters)
                                  ).set_to_current_time()
        last, self._last = self._last, stats

        def grown(field: str) -> float:  # a restarted core starts its counts again
            return max(0, getattr(stats, field) - getattr(last, field))

        self.prefix_queries.inc(grown("num_prefix_cache_queries"))
        self.prefix_hits.inc(grown("num_prefix_cache_hits"))
        self.encoder_queries.inc(grown("num_encoder_cache_queries"))
        self.encoder_hits.inc(grown("num_encoder_cache_hits"))
        self.preemptions.inc(grown("num_preemptions"))
        self.spec_drafts.inc(grown("num_spec_drafts"))
        self.spec_draft_tokens.inc(grown("num_spec_draft_tokens"))
        self.spec_accepted_tokens.inc(grown("num_spec_accepted_tokens"))
        spec = SpecDecodeStats(stats.num_spec_drafts, stats.num_spec_draft_tokens,
                               stats.num_spec_accepted_tokens)
        self.spec_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_accepted_length.set(spec.mean_accepted_length)
        self.grammar_compiles.inc(grown("num_grammar_compiles"))
        self.grammar_compile_seconds.add(stats.grammar_compile_counts,
                                         last.grammar_compile_counts,
                                         grown("grammar_compile_seconds"))
        self.iteration_tokens.add(stats.step_token_counts, last.step_token_counts,
                                  grown("num_step_tokens"))
        self.grammar_cache_hits.inc(grown("num_grammar_cache_hits"))
        self.grammar_cache_misses.inc(grown("num_grammar_cache_misses"))
        self._on_kv_connector(stats.kv_connector, last.kv_connector)
        looked_up = stats.num_grammar_compiles + stats.num_grammar_cache_hits
        if looked_up:
            self.grammar_cache_hit_rate.set(stats.num_grammar_cache_hits / looked_up)

    def _on_kv_connector(self, now: dict[str, float], before: dict[str, float]) -> None:
        """The OffloadingConnector's counters (another connector's names are not shown)."""
        def grown(name: str) -> float:
            return max(0.0, now.get(name, 0) - before.get(name, 0))

        if not now:
            return
        for tier in ("host", "disk"):
            self.kv_offload_hits.labels(tier=tier).inc(grown(f"{tier}_hit_blocks"))
            self.kv_offload_blocks.labels(tier=tier).set(now.get(f"{tier}_blocks", 0))
        self.kv_offload_saved.inc(grown("saved_blocks"))
        self.kv_offload_failed.inc(grown("failed_loads"))
        for direction, verb in (("load", "loaded"), ("save", "saved")):
            self.kv_offload_bytes.labels(direction=direction).inc(grown(f"bytes_{verb}"))
            self.kv_offload_seconds.labels(direction=direction).inc(grown(f"{direction}_seconds"))

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def on_request_rejected(self) -> None:
        self.rejected.inc()

    def on_core_restart(self) -> None:
        self.core_restarts.inc()

    def on_sleep_state(self, asleep: set[str]) -> None:
        state = SLEEP_STATES[2 if "weights" in asleep else 1 if asleep else 0]
        for name, series in self.sleep_states.items():
            series.set(int(name == state))

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics,
                            tokens_per_sample: float) -> None:
        end = metrics.finished_time or time.monotonic()
        if finish_reason in self.requests:
            self.requests[finish_reason].inc()
        self.e2e.observe(end - metrics.arrival_time)
        if self.request_prompt_tokens is not None and metrics.num_prompt_tokens:
            self.params_n.observe(metrics.n)
            self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
            self.request_generation_tokens.observe(tokens_per_sample)
            if metrics.max_tokens is not None:
                self.params_max_tokens.observe(metrics.max_tokens)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        scheduled = metrics.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - metrics.arrival_time))
            self.inference_time.observe(max(0.0, end - scheduled))
        if metrics.first_token_time is None:
            return
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        self.decode_time.observe(end - metrics.first_token_time)
        if scheduled is not None:
            self.prefill_time.observe(max(0.0, metrics.first_token_time - scheduled))
        if tokens_per_sample > 1:
            self.tpot.observe((end - metrics.first_token_time) / (tokens_per_sample - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class CumulativeHistogram:
    """A histogram whose counts come whole from the engine cores (counts per bucket, then one
    for above the last bound; cumulative, so a restarted core adds only what is new)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str],
                 bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def add(self, now: list[int], before: list[int], sum_grown: float) -> None:
        before = before or [0] * len(self.counts)
        for i, (n, then) in enumerate(zip(now, before)):
            self.counts[i] += max(0, n - then)
        self.sum += sum_grown

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative = list(accumulate(self.counts))
        family.add_metric(list(self.labels.values()),
                          [(floatToGoString(le), n) for le, n in zip(self.bounds, cumulative)]
                          + [("+Inf", cumulative[-1])], sum_value=self.sum)
        return [family]
