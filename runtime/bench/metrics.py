"""Benchmark arithmetic: throughput, and TTFT / TPOT / ITL / end-to-end latency from timestamps.

Definitions (as vLLM's benchmarks use them), for one streamed request sent at `start`:
- TTFT: time to the first chunk that carries text.
- ITL: the gaps between successive text chunks.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), for requests of more than one token.
- E2E: time from sending to the last byte.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestRecord:
    """One request as the load generator saw it (times in seconds, from one monotonic clock)."""

    start: float
    prompt_len: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk
    end: float | None = None
    output_tokens: int = 0  # from the server's usage report, else the number of text chunks
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def distribution(values: Sequence[float], percentiles: Sequence[float],
                 scale: float = 1.0) -> dict[str, float]:
    """mean, median, std and the given percentiles of `values` times `scale` (0s when empty)."""
    data = np.asarray(values, dtype=float) * scale
    if data.size == 0:
        data = np.zeros(1)
    result = {"mean": float(data.mean()), "median": float(np.median(data)),
              "std": float(data.std())}
    for p in percentiles:
        result[f"p{p:g}"] = float(np.percentile(data, p))
    return result


def throughput(num_requests: int, prompt_tokens: int, output_tokens: int,
               elapsed: float) -> dict[str, float]:
    return {"elapsed_s": elapsed, "requests_per_s": num_requests / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed}


def serve_summary(records: Sequence[RequestRecord], duration: float,
                  percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    """The serve benchmark's figures: counts, throughput, and latency distributions in ms."""
    ok = [r for r in records if r.success]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    series = {"ttft_ms": [r.ttft for r in ok],
              "tpot_ms": [t for t in (r.tpot for r in ok) if t is not None],
              "itl_ms": [gap for r in ok for gap in r.itl],
              "e2el_ms": [r.e2e for r in ok]}
    for name, values in series.items():
        summary[name] = distribution(values, percentiles, scale=1000.0)
    errors = [r.error for r in records if r.error]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain text table: `columns` are (key, header); floats get 2 decimals, None is '-'."""
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)
    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
