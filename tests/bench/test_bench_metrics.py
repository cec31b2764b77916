"""Metric arithmetic from known timestamps."""
from __future__ import annotations

import pytest

from runtime.bench.metrics import (RequestRecord, distribution, format_table, serve_summary,
                                   throughput)


def test_ttft_itl_tpot_e2e_from_timestamps():
    r = RequestRecord(start=10.0, prompt_len=7, chunk_times=[10.5, 10.6, 10.8, 11.1], end=11.2,
                      output_tokens=4)
    assert r.success
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    single = RequestRecord(start=0.0, prompt_len=1, chunk_times=[0.2], end=0.3, output_tokens=1)
    assert single.tpot is None and single.itl == []
    assert not RequestRecord(start=0.0, prompt_len=1, error="HTTP 500").success


def test_serve_summary_counts_and_distributions():
    ok = [RequestRecord(0.0, 10, [0.1, 0.2, 0.3], 0.3, 3),
          RequestRecord(1.0, 20, [1.3, 1.4, 1.7], 1.7, 3)]
    failed = RequestRecord(0.5, 99, error="HTTP 500: boom")
    s = serve_summary(ok + [failed], duration=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["prompt_tokens"] == 30 and s["output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # 100 and 300 ms
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.3-0.1)/2 and (0.7-0.3)/2
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # 100, 100, 100, 300
    assert s["e2el_ms"]["p99"] == pytest.approx(300 + 0.99 * 400)
    assert s["first_error"] == "HTTP 500: boom"


def test_distribution_and_throughput():
    d = distribution([1.0, 2.0, 3.0, 4.0], [50, 90], scale=10)
    assert d["mean"] == pytest.approx(25.0) and d["p50"] == pytest.approx(25.0)
    assert d["p90"] == pytest.approx(37.0)
    assert distribution([], [99])["p99"] == 0.0
    t = throughput(num_requests=4, prompt_tokens=40, output_tokens=20, elapsed=2.0)
    assert t == {"elapsed_s": 2.0, "requests_per_s": 2.0, "total_tokens_per_s": 30.0,
                 "output_tokens_per_s": 10.0}


def test_format_table():
    text = format_table([{"a": "x", "b": 1.234}, {"a": "long", "b": None}],
                        [("a", "name"), ("b", "value")])
    assert text.splitlines() == ["name  value", "   x   1.23", "long      -"]
