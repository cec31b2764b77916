"""`runtime generate`: one batch of prompts, printed in order."""
from __future__ import annotations

import argparse
from typing import Any

from runtime.cli.engine_args import (add_engine_args, add_sampling_args, engine_kwargs,
                                     sampling_kwargs)


def add_generate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    from runtime import LLM, SamplingParams
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(**sampling_kwargs(args, llm.engine.processor.sampling_defaults))
    use_template = not args.raw and bool(getattr(llm.tokenizer, "chat_template", None))
    if use_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(list(args.prompts), params)
    for prompt, output in zip(args.prompts, outputs):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(output.outputs[0].text.strip())
    return 0
