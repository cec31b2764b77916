"""`runtime models`: the supported architectures, or which implementation runs one model."""
from __future__ import annotations

import argparse
from typing import Any

from runtime.config import MODEL_IMPLS
from runtime.models.registry import architecture_table_markdown


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "models", help="list the supported architectures, or say how a model would run")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face folder, .gguf file or model id: print the "
                             "implementation chosen for it and why")
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto")
    parser.add_argument("--revision", default=None,
                        help="with a model id: the revision in the local Hugging Face cache")
    parser.set_defaults(func=models_command)
    return parser


def models_command(args: argparse.Namespace) -> int:
    if args.model is None:
        print(architecture_table_markdown())
        return 0
    from runtime.config import EngineConfig
    from runtime.model_spec import ModelSpec
    config = EngineConfig(model=args.model, revision=args.revision, model_impl=args.model_impl)
    try:
        choice = ModelSpec.resolve(config).model_config.choice
    except ValueError as e:
        print(e)
        return 1
    print(f"{choice.architecture}: {choice.impl} implementation "
          f"({choice.model_class.__module__}.{choice.model_class.__qualname__}), "
          f"because {choice.reason}")
    return 0
