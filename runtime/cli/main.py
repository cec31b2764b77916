"""The `runtime` command: generate, chat, plugins."""
from __future__ import annotations

import argparse
import logging
import sys

from runtime.cli.bench import add_bench_parser
from runtime.cli.generate import add_generate_parser
from runtime.cli.plugins_cmd import add_plugins_parser
from runtime.cli.serve import add_serve_parser
from runtime.cli.tune import add_tune_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runtime", description="A hardware-pluggable LLM "
                                     "inference engine.")
    parser.add_argument("--log-level", default="INFO",
                        help="DEBUG, INFO (default: start-up choices), WARNING or ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_plugins_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_tune_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for package in ("runtime", "plugins", "platforms", "attention_backends", "quantization"):
        logging.getLogger(package).setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
