"""PNG charts of bench results (matplotlib, headless)."""
from __future__ import annotations

from typing import Any, Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'runtime[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bars(ax, labels: Sequence[str], values: Sequence[float], title: str, unit: str) -> None:
    bars = ax.bar(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_title(title)
    ax.set_ylabel(unit)


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Output and total tokens/s per backend, side by side."""
    plt = _pyplot()
    rows = [r for r in result["results"] if "error" not in r]
    labels = [r["backend"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    _bars(axes[0], labels, [r["output_tokens_per_s"] for r in rows], "output tokens/s", "tok/s")
    _bars(axes[1], labels, [r["total_tokens_per_s"] for r in rows], "total tokens/s", "tok/s")
    fig.suptitle(f"{result['model'].rstrip('/').split('/')[-1]}, {result['dtype']}, "
                 f"{result['num_threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_distributions(series: dict[str, Sequence[float]], title: str, path: str) -> None:
    """One histogram per named series of latencies (ms)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.5), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items()):
        ax.hist(values or [0.0], bins=30, color="tab:blue")
        ax.set_title(name)
        ax.set_xlabel("ms")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_compute(result: dict[str, Any], path: str) -> None:
    """Measured matmul peaks next to the engine's achieved model FLOP/s."""
    plt = _pyplot()
    labels = [f"matmul {k}" for k in result["peak_gflops"]] + ["prefill", "decode"]
    values = list(result["peak_gflops"].values()) + [result["prefill"]["gflops"],
                                                     result["decode"]["gflops"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, labels, values, f"GFLOP/s ({result['dtype']}, {result['num_threads']} threads)",
          "GFLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tune(trials: list[dict[str, Any]], path: str) -> None:
    """Output tokens/s of each tuning trial, the chosen one highlighted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, len(trials) * 0.6), 4))
    values = [t.get("output_tokens_per_s") or 0.0 for t in trials]
    colors = ["tab:green" if t.get("chosen") else "tab:gray" if not t.get("feasible", True)
              else "tab:blue" for t in trials]
    ax.bar([str(t["trial"]) for t in trials], values, color=colors)
    ax.set_xlabel("trial")
    ax.set_ylabel("output tok/s")
    ax.set_title("runtime tune (green: chosen, gray: misses the latency target)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
