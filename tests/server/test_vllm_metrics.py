"""/metrics under vLLM's names, types, labels and buckets (tests/server/vllm_metrics.json,
from vLLM's source), and the Grafana dashboard in examples/grafana reading only what we serve."""
from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import buckets_1_2_5
from tests.server.conftest import API_KEY, REPO

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM = {m["name"]: m for m in json.load(open(os.path.join(HERE, "vllm_metrics.json")))["metrics"]}
DASHBOARD = os.path.join(REPO, "examples", "grafana", "runtime-vllm.json")
AUTH = {"Authorization": f"Bearer {API_KEY}"}

# what we have an equivalent for, so must serve under vLLM's name
SERVED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:cache_config_info",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
}


@pytest.fixture(scope="module")
def scraped(tiny_server):
    """/metrics after a few requests: streamed, not streamed, one sharing a cached prefix."""
    prompt = "The same long opening, shared by two requests so the prefix cache is hit: " * 2
    for body in ({"prompt": prompt, "max_tokens": 4, "ignore_eos": True},
                 {"prompt": prompt + "again", "max_tokens": 4, "ignore_eos": True},
                 {"prompt": "streamed", "max_tokens": 3, "ignore_eos": True, "stream": True}):
        reply = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", **body},
                           headers=AUTH, timeout=120)
        assert reply.status_code == 200, reply.text
    text = httpx.get(tiny_server.url + "/metrics", timeout=10).text
    max_model_len = httpx.post(tiny_server.url + "/tokenize", json={"prompt": "x"},
                               timeout=10).json()["max_model_len"]
    return text, {f.name: f for f in text_string_to_metric_families(text)}, max_model_len


def test_vllm_names_types_labels_and_buckets(scraped):
    _, families, max_model_len = scraped
    # (prometheus_client's `_created` samples, which vLLM's server has too, parse as gauges)
    ours = {name: f for name, f in families.items()
            if name.startswith("vllm:") and not name.endswith("_created")}
    assert SERVED <= set(ours), sorted(SERVED - set(ours))
    for name, family in ours.items():
        assert name in VLLM, f"{name} is not one of vLLM's metrics"
        spec = VLLM[name]
        assert family.type == spec["type"], (name, family.type, spec["type"])
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        assert samples, name
        for sample in samples:
            labels = set(sample.labels) - {"le"}
            if name == "vllm:cache_config_info":
                assert labels <= set(spec["labels"]) and "engine" in labels, labels
                continue
            assert labels == set(spec["labels"]), (name, sorted(labels), spec["labels"])
        if spec["type"] == "histogram":
            want = buckets_1_2_5(max_model_len) if isinstance(spec["buckets"], str) \
                else spec["buckets"]
            bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, want), float("inf")], name


def value(families, name: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_values_follow_the_requests(scraped):
    _, families, _ = scraped
    assert value(families, "vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") >= 3
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") >= 11
    queries = value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert 0 < hits < queries
    for name in ("vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
                 "vllm:request_params_n", "vllm:request_params_max_tokens"):
        assert value(families, name, name + "_count") > 0, name
    # each step computes at least one token; the steps' tokens are at least the generated ones
    assert value(families, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") \
        >= value(families, "vllm:generation_tokens", "vllm:generation_tokens_total")
    # our own names are still served beside vLLM's
    assert value(families, "runtime:generation_tokens", "runtime:generation_tokens_total") == \
        value(families, "vllm:generation_tokens", "vllm:generation_tokens_total")


def test_the_grafana_dashboard_reads_only_what_we_serve(scraped):
    text, families, _ = scraped
    served = {s.name for f in families.values() for s in f.samples}
    labels = {k for f in families.values() for s in f.samples for k in s.labels}
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    assert len(exprs) >= 10
    for expr in exprs:
        names = re.findall(r"\b(?:vllm|runtime):[A-Za-z0-9_:]+", expr)
        assert names, expr
        for name in names:
            assert name in served, f"{expr}: our server does not export {name}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in group.split(","):
                assert label.strip() in labels, f"{expr}: no series has the label {label}"
        for label in re.findall(r"\{(\w+)=~?\"", expr):
            assert label in labels, f"{expr}: no series has the label {label}"


def test_metrics_prefix_chooses_the_names():
    from runtime.metrics import Metrics
    vllm = Metrics("m", "vllm").render().decode()
    runtime = Metrics("m", "runtime").render().decode()
    assert "vllm:num_requests_running" in vllm and "runtime:" not in vllm
    assert "runtime:num_requests_running" in runtime and "vllm:" not in runtime
    with pytest.raises(ValueError, match="metrics prefix must be one of both, vllm, runtime"):
        Metrics("m", "tgi")


def test_the_serve_flag_offers_exactly_the_prefixes_metrics_serves():
    # runtime.cli.serve keeps its own copy: building the CLI parser must not import
    # prometheus_client (the serve extra), which runtime.metrics does.
    from runtime.cli.serve import METRICS_PREFIXES as FLAG_CHOICES
    from runtime.metrics import METRICS_PREFIXES
    assert FLAG_CHOICES == METRICS_PREFIXES
