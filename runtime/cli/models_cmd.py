"""`runtime models`: the supported architectures, or which implementation runs one model."""
from __future__ import annotations

import argparse
from typing import Any

from runtime.models.registry import MODEL_IMPLS, architecture_table_markdown, choose_model


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
    from runtime.model_loader.source import load_config, resolve_model
    source = resolve_model(args.model, None, args.revision)
    config = load_config(source)
    try:
        choice = choose_model(getattr(config, "architectures", None), args.model_impl, config)
    except ValueError as e:
        print(e)
        return 1
    print(f"{choice.architecture}: {choice.impl} implementation "
          f"({choice.model_class.__module__}.{choice.model_class.__qualname__}), "
          f"because {choice.reason}")
    return 0
