"""`runtime generate` and `runtime chat`."""
from __future__ import annotations

import argparse
import sys
import time
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

    c = subparsers.add_parser("chat", help="an interactive chat with the model")
    c.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=chat_command)


def _llm(args: argparse.Namespace):
    from runtime import LLM
    return LLM(**engine_kwargs(args))


def generate_command(args: argparse.Namespace) -> int:
    from runtime import SamplingParams
    llm = _llm(args)
    params = SamplingParams(**sampling_kwargs(args))
    use_template = not args.raw and bool(getattr(llm.tokenizer, "chat_template", None))
    start = time.perf_counter()
    if use_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(list(args.prompts), params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(args.prompts, outputs):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(output.outputs[0].text.strip())
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{len(outputs)} prompts, {generated} tokens in {elapsed:.2f} s, "
          f"{generated / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    from runtime import SamplingParams
    llm = _llm(args)
    params = SamplingParams(**sampling_kwargs(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text.strip()
        messages.append({"role": "assistant", "content": reply})
        print(reply)
    return 0
