"""The `runtime` command: generate, chat, plugins."""
from __future__ import annotations

import argparse
import logging
import sys

from runtime.cli.generate import add_generate_parser
from runtime.cli.plugins_cmd import add_plugins_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runtime", description="A hardware-pluggable LLM "
                                     "inference engine.")
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING (default) or ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_plugins_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
