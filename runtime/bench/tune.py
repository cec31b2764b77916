"""`runtime tune`: pick the engine's knobs for this machine and a workload, and write them as
a YAML config that `LLM(config=...)` and `runtime serve --config` read.

The search is bounded, not a grid: starting from the engine's defaults it tries one knob at a
time (threads, dtype, max_num_seqs, max_num_batched_tokens, block size), each at its candidate
values with the other knobs held at the best found so far, and keeps the best value before
moving on; at most `--max-trials` runs. Each trial runs the whole workload in a fresh process.
A trial is better when it meets the latency targets (p99 TPOT / p99 TTFT, when given) and the
other does not; else when it has more output tokens/s (meeting the targets) or a lower p99 TPOT
(when neither meets them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from runtime.bench import common
from runtime.bench.backends import run_in_subprocess
from runtime.bench.datasets import (SampleRequest, add_dataset_args, build_requests, describe,
                                    workload_text)
from runtime.bench.metrics import format_table, write_json

KNOBS = ("num_threads", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size")
Config = dict[str, Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face folder or a .gguf file (default: the embedded model)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="fixed for every trial")
    parser.add_argument("--output", default="runtime-tuned.yaml", help="the YAML config to write")
    parser.add_argument("--max-trials", type=int, default=12)
    parser.add_argument("--max-p99-tpot-ms", type=float, default=None,
                        help="latency target: p99 time per output token")
    parser.add_argument("--max-p99-ttft-ms", type=float, default=None,
                        help="latency target: p99 time to first token")
    g = parser.add_argument_group("search space (comma-separated candidates)")
    g.add_argument("--num-threads", default=None, help="default: all usable cores, half of them")
    g.add_argument("--dtype", default="float32,bfloat16")
    g.add_argument("--max-num-seqs", default="16,32,64,128,256")
    g.add_argument("--max-num-batched-tokens", default="512,1024,2048,4096")
    g.add_argument("--block-size", default="8,16,32")
    g.add_argument("--timeout", type=float, default=None, help="seconds one trial may run")
    add_dataset_args(parser, num_prompts=64)
    common.add_output_args(parser)


def search_space(args: argparse.Namespace) -> dict[str, list]:
    cores = common.usable_cores()
    halves = dict.fromkeys((cores, max(1, cores // 2)))
    threads = args.num_threads or ",".join(map(str, halves))
    space = {"num_threads": threads, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size}
    return {k: [v.strip() if k == "dtype" else int(v) for v in text.split(",") if v.strip()]
            for k, text in space.items()}


def start_point(space: dict[str, list], default_dtype: str) -> Config:
    """The engine's defaults where the space holds them, else each knob's first candidate."""
    defaults = {"num_threads": common.usable_cores(), "dtype": default_dtype, "max_num_seqs": 256,
                "max_num_batched_tokens": 2048, "block_size": 16}
    return {k: defaults[k] if defaults[k] in space[k] else space[k][0] for k in KNOBS}


def better(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
    """Whether trial `a` beats trial `b` (see the module's docstring)."""
    if b is None:
        return True
    if a["feasible"] != b["feasible"]:
        return a["feasible"]
    if a["feasible"]:
        return a["output_tokens_per_s"] > b["output_tokens_per_s"]
    return a["tpot_p99_ms"] < b["tpot_p99_ms"]


def search(evaluate: Callable[[Config], dict[str, Any]], start: Config,
           space: dict[str, list], max_trials: int,
           log: Callable[[str], None] = print) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Coordinate search; returns the best trial and every trial, in order."""
    trials: list[dict[str, Any]] = []
    seen: dict[tuple, dict[str, Any]] = {}
    best: dict[str, Any] | None = None

    def trial(config: Config, knob: str | None) -> None:
        nonlocal best
        key = tuple(config[k] for k in KNOBS)
        if key in seen or len(trials) >= max_trials:
            return
        result = {"trial": len(trials) + 1, "config": dict(config), **evaluate(config)}
        seen[key] = result
        trials.append(result)
        changed = f"{knob}={config[knob]}" if knob else "start"
        if better(result, best):
            verdict = "best so far"
            best = result
        elif not result["feasible"]:
            verdict = "misses the latency target"
        else:
            verdict = f"slower than trial {best['trial']}"
        log(f"trial {result['trial']:2d} {changed:28s} {result['output_tokens_per_s']:9.1f} "
            f"out tok/s  p99 TPOT {result['tpot_p99_ms']:8.1f} ms  p99 TTFT "
            f"{result['ttft_p99_ms']:9.1f} ms  {verdict}")

    trial(start, None)
    for knob in KNOBS:
        for value in space[knob]:
            trial({**best["config"], knob: value}, knob)
    best["chosen"] = True
    return best, trials


def evaluate_in_subprocess(args: argparse.Namespace, model: str,
                           requests: list[SampleRequest]) -> Callable[[Config], dict[str, Any]]:
    """A trial: the whole workload in a fresh process of our engine with `config`."""
    kv = args.kv_cache_memory
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)

    def evaluate(config: Config) -> dict[str, Any]:
        engine = {k: config[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size")}
        spec = {"backend": "runtime", "model": model, "tokenizer": args.tokenizer,
                "dtype": config["dtype"], "num_threads": config["num_threads"],
                "requests": [(r.prompt_token_ids, r.output_len) for r in requests],
                "engine": {**engine, "kv_cache_memory": kv, "device": args.device}}
        result = run_in_subprocess(spec, timeout=args.timeout)
        if "error" in result:
            print(f"trial failed: {result['error']}", file=sys.stderr)
            return {"error": result["error"], "feasible": False, "output_tokens_per_s": 0.0,
                    "tpot_p99_ms": float("inf"), "ttft_p99_ms": float("inf")}
        tpot = 1000 * float(np.percentile(result["tpot_s"] or [0.0], 99))
        ttft = 1000 * float(np.percentile(result["ttft_s"], 99))
        feasible = ((args.max_p99_tpot_ms is None or tpot <= args.max_p99_tpot_ms)
                    and (args.max_p99_ttft_ms is None or ttft <= args.max_p99_ttft_ms))
        return {"output_tokens_per_s": result["output_tokens"] / result["elapsed_s"],
                "total_tokens_per_s": (prompt_tokens + result["output_tokens"])
                / result["elapsed_s"],
                "tpot_p99_ms": tpot, "ttft_p99_ms": ttft, "feasible": feasible,
                "kv_peak_usage": result["kv_peak_usage"], "allocator": result["allocator"]}

    return evaluate


def explain(best: dict[str, Any], trials: list[dict[str, Any]], args: argparse.Namespace) -> str:
    targets = [f"p99 {name} <= {value:g} ms" for name, value in
               (("TPOT", args.max_p99_tpot_ms), ("TTFT", args.max_p99_ttft_ms))
               if value is not None]
    feasible = [t for t in trials if t["feasible"]]
    if not targets:
        why = f"the most output tokens/s of all {len(trials)} trials"
    elif best["feasible"]:
        why = (f"the most output tokens/s of the {len(feasible)} of {len(trials)} trials "
               f"meeting {' and '.join(targets)}")
    else:
        why = (f"no trial met {' and '.join(targets)}; it has the lowest p99 TPOT of the "
               f"{len(trials)} trials")
    chosen = ", ".join(f"{k}={v}" for k, v in best["config"].items())
    return (f"chose trial {best['trial']} ({chosen}): {best['output_tokens_per_s']:.1f} output "
            f"tok/s, p99 TPOT {best['tpot_p99_ms']:.1f} ms: {why}")


def write_config(path: str, best: dict[str, Any], args: argparse.Namespace, reason: str,
                 machine: dict[str, Any]) -> None:
    """The chosen knobs as a YAML mapping of EngineConfig fields, with how they were chosen."""
    import yaml
    fields = dict(best["config"])
    if args.kv_cache_memory:
        fields["kv_cache_memory"] = args.kv_cache_memory
    header = [f"written by `runtime tune` on {time.strftime('%Y-%m-%d %H:%M')}",
              f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['allocator']}",
              f"model: {common.model_path(args.model)}",
              f"workload: {workload_text(describe(args))}", reason]
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" for line in header))
        yaml.safe_dump(fields, f, sort_keys=False)


def main(args: argparse.Namespace) -> int:
    space = search_space(args)
    machine = common.machine_info(max(space["num_threads"]))
    if common.busy_warning(machine):
        print(common.busy_warning(machine))
    model = common.model_path(args.model)
    requests = build_requests(args, common.load_tokenizer(model, args.tokenizer))
    start = start_point(space, common.resolve_dtype(None, args.device))
    print(f"tuning on {len(requests)} requests ({args.dataset}); at most {args.max_trials} "
          f"trials over {', '.join(f'{k} {v}' for k, v in space.items())}")
    best, trials = search(evaluate_in_subprocess(args, model, requests), start, space,
                          args.max_trials)
    reason = explain(best, trials, args)
    print(reason)
    write_config(args.output, best, args, reason, machine)
    print(f"wrote {args.output}")
    rows = [{"trial": t["trial"], **t["config"], "out tok/s": t["output_tokens_per_s"],
             "p99 TPOT ms": t["tpot_p99_ms"]} for t in trials]
    print(format_table(rows, [(k, k) for k in rows[0]]))
    if args.output_json:
        write_json(args.output_json, {"command": "tune", "model": model, "machine": machine,
                                      "workload": describe(args), "space": space,
                                      "chosen": best["config"], "reason": reason,
                                      "trials": trials})
    if args.plot:
        from runtime.bench.plot import plot_tune
        plot_tune(trials, f"{os.path.basename(model.rstrip('/'))}, "
                          f"{workload_text(describe(args))}", args.plot)
    return 0
