"""What the bench charts say: the workload in the title, skipped backends, counts and
percentile markers."""
from __future__ import annotations

import numpy as np

from runtime.bench.plot import distributions_figure, plot_distributions, throughput_figure

WORKLOAD = {"dataset": "random", "num_prompts": 4, "input_len": 8, "output_len": 4,
            "range_ratio": 0.0, "seed": 0}


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def test_throughput_chart_names_the_workload_and_the_skipped_backends():
    result = {"model": "/m/tiny", "dtype": "float32", "num_threads": 2, "workload": WORKLOAD,
              "results": [{"backend": "runtime", "output_tokens_per_s": 10.0,
                           "total_tokens_per_s": 30.0},
                          {"backend": "vllm", "error": "vLLM is not installed\n(details)"}]}
    shown = texts(throughput_figure(result))
    assert any("tiny, float32, 2 threads" in t and
               "random: num_prompts=4, input_len=8, output_len=4" in t for t in shown), shown
    assert "skipped: vllm (vLLM is not installed)" in shown


def test_a_long_skip_reason_is_shown_whole_and_wrapped():
    reason = ("the hf process exited with 1: ValueError: accelerate is required when loading a "
              "GGUF file: pip install accelerate, or load the converted folder instead of it")
    result = {"model": "/m/tiny", "dtype": "float32", "num_threads": 2, "workload": WORKLOAD,
              "results": [{"backend": "runtime", "output_tokens_per_s": 10.0,
                           "total_tokens_per_s": 30.0},
                          {"backend": "hf", "error": reason + "\nTraceback (most recent call last)"}]}
    (note,) = [t for t in texts(throughput_figure(result)) if t.startswith("skipped:")]
    assert "\n" in note
    assert " ".join(note.split()) == f"skipped: hf ({reason})"


def test_latency_histograms_label_counts_and_mark_percentiles(tmp_path):
    values = list(np.linspace(1.0, 100.0, 200))
    fig = distributions_figure({"TTFT": values, "ITL": []}, "serve: random", "requests")
    ttft, itl = fig.axes[:2]
    assert ttft.get_title() == "TTFT (n=200)" and itl.get_title() == "ITL (n=0)"
    assert ttft.get_ylabel() == "requests" and ttft.get_xlabel() == "ms"
    labels = [t.get_text() for t in ttft.get_legend().get_texts()]
    expected = np.percentile(values, [50, 90, 99])
    assert labels == [f"p{p} {v:.1f} ms" for p, v in zip((50, 90, 99), expected)]
    assert "no samples" in texts(fig)
    png = tmp_path / "d.png"
    plot_distributions({"TTFT": values}, "serve: random", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
