"""`runtime tune`: pick the engine's knobs for this machine and a workload."""
from __future__ import annotations

import argparse
from typing import Any


def add_tune_parser(subparsers: Any) -> None:
    from runtime.bench import tune
    p = subparsers.add_parser("tune", help="search engine settings for a workload; writes YAML",
                              description=tune.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_arguments(p)
    p.set_defaults(func=tune.main)
