"""`runtime bench throughput | latency | serve | compute`."""
from __future__ import annotations

import argparse
import importlib
from typing import Any

COMMANDS = {
    "throughput": "offline throughput of one workload on runtime, hf and vllm, in one table",
    "latency": "end-to-end latency of one batch, repeated after warm-up",
    "serve": "an async load generator against an OpenAI-compatible server",
    "compute": "matmul peak FLOP/s and the engine's achieved model FLOP/s",
}


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(COMMANDS))
    commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"runtime.bench.{name}")
        p = commands.add_parser(name, help=help_text, description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=_run, bench_main=module.main)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "plot", None):
        from runtime.bench.plot import require_matplotlib
        require_matplotlib()
    return args.bench_main(args)
