"""The `runtime` command: generate, chat, plugins, serve, disagg-proxy, bench, tune."""
from __future__ import annotations

import argparse
import logging
import sys

from runtime import __version__
from runtime.cli.bench import add_bench_parser
from runtime.cli.chat import add_chat_parser
from runtime.cli.disagg_proxy_cmd import add_disagg_proxy_parser
from runtime.cli.generate import add_generate_parser
from runtime.cli.models_cmd import add_models_parser
from runtime.cli.plugins_cmd import add_plugins_parser
from runtime.cli.serve import add_serve_parser
from runtime.cli.tune import add_tune_parser

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_HELP = ("DEBUG, INFO (the default: start-up choices), WARNING or ERROR; `plugins` and "
                  "`models` print tables and default to WARNING")
# Commands whose output is a report: the start-up choices they make on the way would bury it.
QUIET_COMMANDS = ("plugins", "models")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runtime", description="A hardware-pluggable LLM "
                                     "inference engine.")
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--log-level", default=None, type=str.upper, choices=LOG_LEVELS,
                        help=LOG_LEVEL_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_chat_parser(subparsers)
    add_plugins_parser(subparsers)
    add_models_parser(subparsers)
    add_serve_parser(subparsers)
    add_disagg_proxy_parser(subparsers)
    add_bench_parser(subparsers)
    add_tune_parser(subparsers)
    _accept_log_level_everywhere(parser)
    return parser


def _accept_log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--log-level` after the subcommand too (`runtime serve --log-level WARNING`); given
    there, it wins over the one before the subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                                 choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
                _accept_log_level_everywhere(sub)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        default = "WARNING" if args.command in QUIET_COMMANDS else "INFO"
        logging.getLogger("runtime").setLevel(args.log_level or default)
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, NotImplementedError, FileNotFoundError, NotADirectoryError,
            PermissionError, IsADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
