"""`runtime bench throughput`: offline throughput of one workload on several backends.

Each backend runs in a fresh process of its own, one after another, with the same model,
prompts (as token ids), dtype, thread count and output lengths (`ignore_eos`), and the same
environment, hence the same malloc; the figures land in one table. With `--num-iters N` the
backends run N rounds, the order reversed every other round, so that a machine whose speed
drifts (a shared VM) weighs on every backend alike: each row is its backend's median run, and
the ratio to the first backend is the median of the rounds' own ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from runtime.bench import common
from runtime.bench.backends import BACKENDS, run_in_subprocess
from runtime.bench.datasets import (SampleRequest, add_dataset_args, build_requests, describe,
                                    workload_text)
from runtime.bench.metrics import format_table, throughput, write_json
from runtime.bench.structured import STRUCTURED_OUTPUTS, overhead, schemas
from runtime.cli.engine_args import add_engine_args, engine_kwargs
from runtime.config import parse_size
from runtime.core.spec_stats import SpecDecodeStats

SHARED = ("model", "tokenizer", "dtype", "num_threads")  # given to every backend
COLUMNS = [("backend", "backend"), ("version", "version"), ("requests_per_s", "req/s"),
           ("total_tokens_per_s", "total tok/s"), ("output_tokens_per_s", "output tok/s"),
           ("elapsed_s", "time s"), ("kv_peak_mib", "KV peak MiB"),
           ("kv_peak_usage", "KV peak %"), ("prefix_hit_pct", "prefix hit %"),
           ("spec_acceptance", "spec accept %"),
           ("spec_mean_accepted_length", "spec tok/step"), ("decode_step_ms", "decode ms/step"),
           ("allocator", "allocator")]
ROUND_COLUMNS = (COLUMNS[:5] + [("output_tokens_per_s_min", "min"),
                                 ("output_tokens_per_s_max", "max"), ("runs", "runs")]
                 + COLUMNS[5:])  # with --num-iters: each row's range over its runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="runtime",
                        help=f"comma-separated, run in this order: {', '.join(BACKENDS)}")
    parser.add_argument("--allow-skip", action="store_true",
                        help="exit 0 when some backends failed and others ran (default: any "
                             "failed backend makes the command exit 1)")
    parser.add_argument("--task", choices=("generate", "embed"), default="generate",
                        help="embed: a pooling model's embeddings of the prompts (runtime, hf "
                             "as sentence-transformers' encode runs it); req/s is sentences/s")
    parser.add_argument("--hf-batch-size", type=int, default=64,
                        help="hf: prompts per generate() call")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the Python interpreter of a virtual environment with vLLM's CPU "
                             "build (default: this one)")
    parser.add_argument("--model-cache-dir", default=common.MODEL_CACHE,
                        help="where a GGUF model is converted once for backends that need a "
                             "Hugging Face folder (vllm)")
    parser.add_argument("--num-iters", type=int, default=1,
                        help="rounds of every backend, the order reversed every other round; "
                             "each row is its backend's median run")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one backend may run before it is stopped")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="runtime: LoRA adapters the requests take in turn (request i the "
                             "adapter i mod N), all in the same batches (docs/lora.md)")
    parser.add_argument("--structured-outputs", choices=STRUCTURED_OUTPUTS, default=None,
                        help="runtime: run the requests again, each constrained to a JSON schema "
                             "(json: one schema for all, json-unique: one each), and report the "
                             "grammar's cost per decode step (docs/structured_outputs.md)")
    add_dataset_args(parser)
    add_engine_args(parser)
    common.add_output_args(parser)


def parse_backends(text: str) -> list[str]:
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"--backend takes a comma-separated list of {', '.join(BACKENDS)}, "
                         f"got {text!r}")
    return backends


def make_spec(backend: str, model: str, args: argparse.Namespace, dtype: str, threads: int,
              requests: list[SampleRequest], tokenizer: Any) -> dict[str, Any]:
    """Everything one backend's process needs; the same requests and settings for all."""
    engine = {k: v for k, v in engine_kwargs(args).items() if k not in SHARED}
    loras = getattr(args, "lora_modules", None) or []
    if loras:
        if backend != "runtime":
            raise ValueError(f"--lora-modules runs on the runtime backend only, not {backend}")
        engine.update(enable_lora=True, max_loras=max(engine["max_loras"], len(loras)))
    return {"backend": backend, "model": model, "tokenizer": args.tokenizer, "dtype": dtype,
            "num_threads": threads, "task": getattr(args, "task", "generate"),
            "requests": [(r.prompt_token_ids, r.output_len) for r in requests],
            "images": [r.images for r in requests],
            "engine": engine, "kv_cache_memory": parse_size(engine.get("kv_cache_memory")),
            "hf_batch_size": args.hf_batch_size, "lora_modules": loras,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
            else (tokenizer.eos_token_id or 0),
            "max_model_len": max(len(r.prompt_token_ids) + r.output_len for r in requests)}


def summarize(result: dict[str, Any], requests: list[SampleRequest]) -> dict[str, Any]:
    """One table row from a backend's raw result."""
    if "error" in result:
        return {"backend": result["backend"], "error": result["error"]}
    row = {k: result.get(k) for k in ("backend", "version", "allocator", "torch_threads")}
    row.update(throughput(len(requests), sum(len(r.prompt_token_ids) for r in requests),
                          result["output_tokens"], result["elapsed_s"]))
    row["output_tokens"] = result["output_tokens"]
    if result.get("decode_steps"):
        row["decode_step_ms"] = 1000.0 * result["decode_step_s"]
        row["decode_batch"] = result["decode_batch"]
    for key in ("kv_peak_bytes", "kv_capacity_bytes"):
        if result.get(key) is not None:
            row[key.replace("bytes", "mib")] = result[key] / 2**20
    if result.get("prefix_cached_tokens") is not None:  # prompt tokens served by the cache
        row["prefix_hit_pct"] = 100.0 * result["prefix_cached_tokens"] / max(
            1, sum(len(r.prompt_token_ids) for r in requests))
    if result.get("kv_peak_usage") is not None:
        row["kv_peak_usage"] = 100.0 * result["kv_peak_usage"]
    if result.get("spec_draft_tokens"):
        stats = SpecDecodeStats(result["spec_drafts"], result["spec_draft_tokens"],
                                result["spec_accepted_tokens"])
        row["spec_acceptance"] = 100.0 * stats.acceptance_rate
        row["spec_mean_accepted_length"] = stats.mean_accepted_length
    return row


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output tok/s (the lower of the middle two for an even count) among
    a backend's runs that did not fail, with their count and range; the first failure if all
    failed."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    speed = statistics.median_low(r["output_tokens_per_s"] for r in ok)
    row = dict(next(r for r in ok if r["output_tokens_per_s"] == speed))
    if len(runs) > 1:
        row.update(runs=len(ok), output_tokens_per_s_min=min(r["output_tokens_per_s"] for r in ok),
                   output_tokens_per_s_max=max(r["output_tokens_per_s"] for r in ok))
    return row


def round_ratios(rounds: list[dict[str, dict[str, Any]]],
                 backends: list[str]) -> dict[str, dict[str, float]]:
    """Output tok/s of the first backend over each other one's, per round (the two ran minutes
    apart), as median, min and max over the rounds where both ran."""
    first, ratios = backends[0], {}
    for other in backends[1:]:
        values = [r[first]["output_tokens_per_s"] / r[other]["output_tokens_per_s"]
                  for r in rounds if "error" not in r[first] and "error" not in r[other]]
        if values:
            ratios[f"{first}/{other}"] = {"median": statistics.median(values),
                                          "min": min(values), "max": max(values),
                                          "rounds": len(values)}
    return ratios


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every backend of `args.backend` on one workload; returns the report."""
    backends = parse_backends(args.backend)
    model = common.model_path(args.model)
    if "vllm" in backends and model.endswith(".gguf"):
        model = common.hf_folder(model, args.model_cache_dir)
    dtype = common.resolve_dtype(args.dtype, args.device)
    threads = args.num_threads or common.usable_cores()
    machine = common.machine_info(threads)  # before any backend loads the machine
    tokenizer = common.load_tokenizer(model, args.tokenizer)
    requests = build_requests(args, tokenizer, model)
    structured = getattr(args, "structured_outputs", None)
    if structured and backends != ["runtime"]:
        raise ValueError("--structured-outputs runs on the runtime backend only")
    iters = getattr(args, "num_iters", 1)
    if iters < 1:
        raise ValueError(f"--num-iters must be at least 1, got {iters}")
    specs = {b: make_spec(b, model, args, dtype, threads, requests, tokenizer) for b in backends}
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(iters):
        ran = {}
        for backend in backends if i % 2 == 0 else backends[::-1]:
            print(f"running {backend}" + (f" (round {i + 1} of {iters})" if iters > 1 else "")
                  + " ...", file=sys.stderr, flush=True)
            python = args.vllm_python if backend == "vllm" else sys.executable
            ran[backend] = summarize(run_in_subprocess(specs[backend], python, args.timeout),
                                     requests)
        rounds.append(ran)
    rows = [median_run([r[b] for r in rounds]) for b in backends]
    result = {"command": "throughput", "model": model, "dtype": dtype, "num_threads": threads,
              "workload": describe(args), "machine": machine, "results": rows}
    if iters > 1:
        result["rounds"] = [[r[b] for b in (backends if i % 2 == 0 else backends[::-1])]
                            for i, r in enumerate(rounds)]
        result["ratios"] = round_ratios(rounds, backends)
    if structured:
        print(f"running runtime with {structured} schemas ...", file=sys.stderr, flush=True)
        spec = {**specs["runtime"], "structured_outputs": schemas(structured, len(requests))}
        row = summarize(run_in_subprocess(spec, sys.executable, args.timeout), requests)
        rows.append({**row, "backend": f"runtime+{structured}"})
        if "error" not in rows[0] and "error" not in row:
            result["structured_outputs"] = {"kind": structured, **overhead(rows[0], row)}
    return result


def report(result: dict[str, Any]) -> str:
    ok = [r for r in result["results"] if "error" not in r]
    lines = [f"model {result['model']}, dtype {result['dtype']}, {result['num_threads']} "
             f"threads, workload {workload_text(result['workload'])}",
             format_table(ok, ROUND_COLUMNS if any("runs" in r for r in ok) else COLUMNS)]
    lines += [f"{r['backend']}: skipped: {r['error']}" for r in result["results"] if "error" in r]
    for name, ratio in result.get("ratios", {}).items():
        lines.append(f"output tok/s {name}: {ratio['median']:.2f}x, the median of "
                     f"{ratio['rounds']} rounds ({ratio['min']:.2f}x-{ratio['max']:.2f}x)")
    allocators = {r["allocator"] for r in ok}
    if len(allocators) > 1:
        lines.append(f"warning: the backends ran under different allocators {sorted(allocators)}")
    if any(a.startswith("glibc (default") for a in allocators):
        lines.append(common.ALLOCATOR_NOTE)
    so = result.get("structured_outputs")
    if so:
        lines.append(f"structured outputs ({so['kind']}): decode step "
                     f"{so['plain_decode_step_ms']:.1f} ms unconstrained, "
                     f"{so['structured_decode_step_ms']:.1f} ms with grammars "
                     f"({so.get('decode_step_overhead_pct', float('nan')):+.1f} %); output "
                     f"{so['plain_output_tokens_per_s']:.1f} -> "
                     f"{so['structured_output_tokens_per_s']:.1f} tok/s")
    if common.busy_warning(result["machine"]):
        lines.append(common.busy_warning(result["machine"]))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(report(result))
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from runtime.bench.plot import plot_throughput
        plot_throughput(result, args.plot)
    failed = sum("error" in r for r in result["results"])
    if failed == len(result["results"]) or (failed and not args.allow_skip):
        return 1
    return 0

