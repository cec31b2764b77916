"""PNG charts of bench results (matplotlib, headless). Each chart names the workload it measured
in its title; skipped backends and sample counts are written on it, and latency histograms mark
their percentiles. `*_figure` builds a chart, `plot_*` saves it."""
from __future__ import annotations

import textwrap
from typing import Any, Sequence

import numpy as np

from runtime.bench.datasets import workload_text

PERCENTILES = (50, 90, 99)
PERCENTILE_STYLES = {50: "-", 90: "--", 99: ":"}


def require_matplotlib() -> None:
    """Exit with the install hint when matplotlib is missing: checked before any backend runs,
    so a missing plotting library fails in a second, not after the benchmark."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install 'runtime[bench]'") from None


def _pyplot():
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def _bars(ax, labels: Sequence[str], values: Sequence[float], title: str, unit: str) -> None:
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_title(title)
    ax.set_ylabel(unit)


def throughput_figure(result: dict[str, Any]) -> Any:
    """Output and total tokens/s per backend, side by side; the skipped ones noted below."""
    plt = _pyplot()
    rows = [r for r in result["results"] if "error" not in r]
    skipped = [r for r in result["results"] if "error" in r]
    labels = [r["backend"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    _bars(axes[0], labels, [r["output_tokens_per_s"] for r in rows], "output tokens/s", "tok/s")
    _bars(axes[1], labels, [r["total_tokens_per_s"] for r in rows], "total tokens/s", "tok/s")
    fig.suptitle(f"{result['model'].rstrip('/').split('/')[-1]}, {result['dtype']}, "
                 f"{result['num_threads']} threads\n{workload_text(result['workload'])}")
    if skipped:
        note = textwrap.fill("skipped: " + "; ".join(
            f"{r['backend']} ({str(r['error']).splitlines()[0]})" for r in skipped), width=150)
        lines = note.count("\n") + 1
        fig.text(0.01, 0.01, note, fontsize=8, color="tab:red", va="bottom")
        fig.subplots_adjust(bottom=0.12 + 0.04 * lines)
    return fig


def distributions_figure(series: dict[str, Sequence[float]], title: str,
                         count_label: str = "requests") -> Any:
    """One histogram per named series of latencies (ms), with p50/p90/p99 marked and the count
    of samples in each panel's title."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.8), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items()):
        ax.set_title(f"{name} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel(count_label)
        if not values:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=30, color="tab:blue")
        for p, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
            ax.axvline(value, color="tab:red", linestyle=PERCENTILE_STYLES[p],
                       label=f"p{p} {value:.1f} ms")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def compute_figure(result: dict[str, Any]) -> Any:
    """Measured matmul peaks next to the engine's achieved model FLOP/s."""
    plt = _pyplot()
    labels = [f"matmul {k}" for k in result["peak_gflops"]] + ["prefill", "decode"]
    values = list(result["peak_gflops"].values()) + [result["prefill"]["gflops"],
                                                     result["decode"]["gflops"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, labels, values, f"{result['model'].rstrip('/').split('/')[-1]}: GFLOP/s "
          f"({result['dtype']}, {result['num_threads']} threads)", "GFLOP/s")
    return fig


def tune_figure(trials: list[dict[str, Any]], workload: str) -> Any:
    """Output tokens/s of each tuning trial, the chosen one highlighted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, len(trials) * 0.6), 4))
    values = [t.get("output_tokens_per_s") or 0.0 for t in trials]
    colors = ["tab:green" if t.get("chosen") else "tab:gray" if not t.get("feasible", True)
              else "tab:blue" for t in trials]
    ax.bar([str(t["trial"]) for t in trials], values, color=colors)
    ax.set_xlabel("trial")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"runtime tune (green: chosen, gray: misses the latency target)\n{workload}",
                 fontsize=9)
    return fig


def plot_throughput(result: dict[str, Any], path: str) -> None:
    _save(throughput_figure(result), path)


def plot_distributions(series: dict[str, Sequence[float]], title: str, path: str,
                       count_label: str = "requests") -> None:
    _save(distributions_figure(series, title, count_label), path)


def plot_compute(result: dict[str, Any], path: str) -> None:
    _save(compute_figure(result), path)


def plot_tune(trials: list[dict[str, Any]], workload: str, path: str) -> None:
    _save(tune_figure(trials, workload), path)
