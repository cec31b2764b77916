"""Engine options as command-line flags, shared by every subcommand that starts an engine:
one flag per `EngineConfig` field, built from the field's declaration (runtime.config)."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from runtime.config import EngineConfig, Flag, flag_of


def engine_flags() -> list[tuple[str, Flag, Any]]:
    """(field name, its flag, its default) for every engine option a user sets."""
    return [(f.name, flag_of(f), f.default) for f in fields(EngineConfig)
            if flag_of(f) is not None and f.default is not MISSING]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, Any] = {}
    for name, flag, default in engine_flags():
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        g = groups[flag.group]
        names = ["--" + name.replace("_", "-"), *flag.aliases]
        if isinstance(default, bool):
            action = "store_true" if flag.store_true else argparse.BooleanOptionalAction
            g.add_argument(*names, dest=name, action=action, default=default, help=flag.help)
            for negation in flag.negations:
                g.add_argument(negation, dest=name, action="store_false",
                               help=f"same as --no-{name.replace('_', '-')}")
        else:
            kind = flag.type or (type(default) if default is not None else str)
            g.add_argument(*names, dest=name, type=kind, choices=flag.choices,
                           default=default, help=flag.help)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name, _, _ in engine_flags()}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling", "a flag left out takes the model's generation config (--generation-config), "
        "else SamplingParams' default")
    g.add_argument("--max-tokens", type=int, default=None, help="default: 256")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords: the flags given, over `defaults` (the generation config's)."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty, "seed": args.sampling_seed,
             "stop": args.stop}
    merged = {"max_tokens": 256, **defaults}
    merged.update({k: v for k, v in given.items() if v is not None})
    return merged
