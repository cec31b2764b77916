"""`runtime bench latency`: one batch end to end (prefill and every decode step), repeated.

Warm-up iterations run first and are not counted; the prefix cache is emptied before each
iteration, so every one computes the whole batch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from runtime.bench import common
from runtime.bench.datasets import random_requests
from runtime.bench.metrics import distribution, write_json
from runtime.cli.engine_args import add_engine_args, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--percentiles", default="10,25,50,75,90,99")
    add_engine_args(parser)
    common.add_output_args(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runtime import LLM, SamplingParams
    machine = common.machine_info(args.num_threads or torch.get_num_threads())
    llm = LLM(**engine_kwargs(args))
    prompts = [{"prompt_token_ids": r.prompt_token_ids}
               for r in random_requests(llm.tokenizer, args.batch_size, args.input_len,
                                        args.output_len, seed=args.seed)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def once() -> float:
        llm.engine.core.kv.pool.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        once()
    latencies = []
    for i in range(args.num_iters):
        latencies.append(once())
        print(f"iteration {i + 1}/{args.num_iters}: {latencies[-1]:.3f} s", file=sys.stderr)
    percentiles = [float(p) for p in args.percentiles.split(",")]
    threads = torch.get_num_threads()
    config = llm.engine.config
    return {"command": "latency", "model": llm.engine.source.path,
            "dtype": str(llm.engine.model_config.dtype).removeprefix("torch."),
            "num_threads": threads, "batch_size": args.batch_size, "input_len": args.input_len,
            "output_len": args.output_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "latencies_s": latencies, "latency_s": distribution(latencies, percentiles),
            "output_tokens_per_s": args.batch_size * args.output_len / (sum(latencies)
                                                                         / len(latencies)),
            "machine": machine}


def main(args: argparse.Namespace) -> int:
    result = run(args)
    stats = result["latency_s"]
    print(f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out), "
          f"{result['dtype']}, {result['num_threads']} threads, allocator "
          f"{result['machine']['allocator']}")
    print("  ".join(f"{k} {v:.3f} s" for k, v in stats.items()))
    print(f"output tokens/s (mean): {result['output_tokens_per_s']:.1f}")
    if common.busy_warning(result["machine"]):
        print(common.busy_warning(result["machine"]))
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        from runtime.bench.plot import plot_distributions
        plot_distributions(
            {"batch latency": [1000 * t for t in result["latencies_s"]]},
            f"runtime bench latency: {os.path.basename(result['model'].rstrip('/'))}, "
            f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out), "
            f"{result['dtype']}, {result['num_threads']} threads", args.plot, "iterations")
    return 0
