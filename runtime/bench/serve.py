"""`runtime bench serve`: an async load generator against any OpenAI-compatible server.

Requests leave at a Poisson rate (or all at once with `--request-rate inf`), at most
`--max-concurrency` in flight, each streaming its reply (SSE); the time of every text chunk gives
TTFT, ITL and TPOT, and the last byte the end-to-end latency. Output tokens are counted from the
server's usage report (`stream_options.include_usage`) where it sends one, else as text chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

from runtime.bench import common
from runtime.bench.datasets import (SampleRequest, add_dataset_args, build_requests, describe,
                                    workload_text)
from runtime.bench.metrics import RequestRecord, format_table, serve_summary, write_json
from runtime.progress import progress_bar

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None,
                        help="the model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=None,
                        help="sent as a bearer token (default: OPENAI_API_KEY, else none)")
    parser.add_argument("--tokenizer", default=None,
                        help="a local tokenizer (.gguf or folder) to build prompts with "
                             "(default: the embedded default model's)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (outputs may then end early)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--percentiles", default="50,90,99")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    add_dataset_args(parser, num_prompts=100)
    common.add_output_args(parser)


def payload(endpoint: str, model: str, request: SampleRequest, ignore_eos: bool) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict) -> str:
    """The text a streamed completion or chat chunk carries ("" for none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: Any, url: str, body: dict, record: RequestRecord) -> None:
    """Stream one request, filling `record` as chunks arrive."""
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk_text(chunk):
                    record.chunk_times.append(time.perf_counter())
                    chunks += 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.output_tokens = usage["completion_tokens"]
        record.end = time.perf_counter()
        record.output_tokens = record.output_tokens or chunks
        if not record.chunk_times:
            record.error = "the stream carried no text"
    except Exception as e:  # a failed request is counted, not fatal
        record.error = f"{type(e).__name__}: {e}"


async def benchmark(base_url: str, endpoint: str, model: str, requests: list[SampleRequest],
                    request_rate: float = float("inf"), max_concurrency: int | None = None,
                    ignore_eos: bool = True, timeout: float = 600.0, seed: int = 0,
                    api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send every request; returns their records and the run's duration in seconds."""
    import httpx
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url.rstrip("/") + endpoint
    records: list[RequestRecord] = []

    async def one(client: httpx.AsyncClient, request: SampleRequest) -> None:
        if limit:
            await limit.acquire()
        try:
            record = RequestRecord(start=time.perf_counter(),
                                   prompt_len=len(request.prompt_token_ids))
            records.append(record)
            await send(client, url, payload(endpoint, model, request, ignore_eos), record)
        finally:
            if limit:
                limit.release()

    connections = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=timeout, limits=connections,
                                 headers=auth_headers(api_key)) as client:
        start = time.perf_counter()
        tasks = []
        with progress_bar(desc="Requests done", unit="req", total=len(requests)) as bar:
            for i, request in enumerate(requests):
                if i and request_rate != float("inf"):
                    await asyncio.sleep(rng.exponential(1.0 / request_rate))
                task = asyncio.create_task(one(client, request))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models",
                             headers=auth_headers(api_key), timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"cannot list the models of {base_url}: {e}") from None
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    return models[0]["id"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = common.load_tokenizer(common.model_path(args.tokenizer))
    requests = build_requests(args, tokenizer)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model or served_model(args.base_url, api_key)
    print(f"sending {len(requests)} requests to {args.base_url}{args.endpoint} ({model}), "
          f"rate {args.request_rate}, max concurrency {args.max_concurrency}", file=sys.stderr)
    records, duration = asyncio.run(benchmark(
        args.base_url, args.endpoint, model, requests, args.request_rate, args.max_concurrency,
        args.ignore_eos, args.timeout, args.seed, api_key))
    percentiles = [float(p) for p in args.percentiles.split(",")]
    return {"command": "serve", "base_url": args.base_url, "endpoint": args.endpoint,
            "model": model, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "workload": describe(args),
            **serve_summary(records, duration, percentiles),
            "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                          "ttft_s": r.ttft if r.success else None,
                          "tpot_s": r.tpot if r.success else None,
                          "e2e_s": r.e2e if r.success else None, "itl_s": r.itl,
                          "error": r.error} for r in records]}


def report(result: dict[str, Any]) -> str:
    lines = [f"completed {result['completed']}, failed {result['failed']} in "
             f"{result['duration_s']:.2f} s",
             f"request throughput {result['request_throughput']:.2f} req/s, output "
             f"{result['output_throughput']:.1f} tok/s, total "
             f"{result['total_token_throughput']:.1f} tok/s"]
    stats = [k for k in result["ttft_ms"] if k != "std"]
    rows = [{"metric": f"{label} ms", **result[key]} for key, label in METRICS]
    lines.append(format_table(rows, [("metric", "")] + [(k, k) for k in stats]))
    if result.get("first_error"):
        lines.append(f"first error: {result['first_error']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(report(result))
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from runtime.bench.plot import plot_distributions
        ok = [r for r in result["requests"] if r["error"] is None]
        plot_distributions({"TTFT": [1000 * r["ttft_s"] for r in ok],
                            "TPOT": [1000 * r["tpot_s"] for r in ok if r["tpot_s"] is not None],
                            "ITL": [1000 * g for r in ok for g in r["itl_s"]],
                            "E2E": [1000 * r["e2e_s"] for r in ok]},
                           f"runtime bench serve: {result['model']}, rate {args.request_rate}, "
                           f"max concurrency {args.max_concurrency}\n"
                           f"{workload_text(result['workload'])}", args.plot)
    return 0 if result["completed"] else 1
