"""Benchmark workloads: random prompts, prompts sharing long prefixes, prompts that repeat a
phrase (where speculative n-gram lookup shines), or a JSONL file.

Every request carries both its text (what `bench serve` sends) and its token ids (what the
offline backends get), and the number of tokens to generate.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DATASETS = ("random", "random-mm", "prefix-repetition", "repeated-phrase", "jsonl")


@dataclass
class SampleRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    # random-mm: (seed, side) of each random square image, its placeholder in the prompt
    images: list[tuple[int, int]] = field(default_factory=list)


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids a random prompt may use: the tokenizer's whole vocabulary less its special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def random_text(tokenizer: Any, n: int, rng: np.random.Generator,
                allowed: np.ndarray) -> tuple[str, list[int]]:
    """`n` random tokens, and their text. Decoding then re-encoding can merge or split tokens,
    so a few rounds bring the ids to a fixed point of that round trip where one is found."""
    ids = rng.choice(allowed, n).tolist()
    for _ in range(4):
        again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        if again == ids:
            break
        ids = (again + rng.choice(allowed, n).tolist())[:n]
    return tokenizer.decode(ids), ids


def lengths(mean: int, range_ratio: float, count: int, rng: np.random.Generator) -> list[int]:
    """`count` lengths drawn uniformly from [mean*(1-r), mean*(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, count).tolist()


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    ins = lengths(input_len, range_ratio, num_prompts, rng)
    outs = lengths(output_len, range_ratio, num_prompts, rng)
    return [SampleRequest(*random_text(tokenizer, n, rng, allowed), out)
            for n, out in zip(ins, outs)]


def random_mm_requests(tokenizer: Any, placeholder_id: int, num_prompts: int, input_len: int,
                       output_len: int, range_ratio: float, images_per_prompt: int,
                       image_size: int, seed: int) -> list[SampleRequest]:
    """`random` prompts, each opening with `images_per_prompt` image placeholders: images of
    `image_size` pixels square, random pixels, one seed per image (vLLM's random-mm)."""
    base = random_requests(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    return [SampleRequest(r.prompt, [placeholder_id] * images_per_prompt + r.prompt_token_ids,
                          r.output_len, [(seed * 100003 + i * images_per_prompt + k, image_size)
                                         for k in range(images_per_prompt)])
            for i, r in enumerate(base)]


def prefix_repetition_requests(tokenizer: Any, num_prompts: int, prefix_len: int,
                               suffix_len: int, num_prefixes: int, output_len: int,
                               seed: int = 0) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by an equal share of the prompts (each with
    its own random suffix), in random order."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"need 1 <= num_prefixes <= num_prompts, got {num_prefixes} "
                         f"prefixes for {num_prompts} prompts")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    prefixes = [random_text(tokenizer, prefix_len, rng, allowed) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        text, ids = prefixes[i % num_prefixes]
        suffix_text, suffix_ids = random_text(tokenizer, suffix_len, rng, allowed)
        requests.append(SampleRequest(text + suffix_text, ids + suffix_ids, output_len))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def repeated_phrase_requests(tokenizer: Any, num_prompts: int, input_len: int, phrase_len: int,
                             output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Each prompt: a random phrase of `phrase_len` tokens of its own, repeated up to
    `input_len` tokens. A model tends to go on repeating it."""
    if not 1 <= phrase_len <= input_len:
        raise ValueError(f"need 1 <= phrase_len <= input_len, got phrase_len {phrase_len} "
                         f"and input_len {input_len}")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    requests = []
    for _ in range(num_prompts):
        _, phrase = random_text(tokenizer, phrase_len, rng, allowed)
        ids = (phrase * -(-input_len // phrase_len))[:input_len]
        requests.append(SampleRequest(tokenizer.decode(ids), ids, output_len))
    return requests


def jsonl_requests(path: str, tokenizer: Any, output_len: int,
                   num_prompts: int | None = None) -> list[SampleRequest]:
    """One JSON object per line: "prompt" (text), and optionally "output_len"."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each line must be an object with a "
                                 "\"prompt\" string")
            requests.append(SampleRequest(row["prompt"], tokenizer.encode(row["prompt"]),
                                          int(row.get("output_len", output_len))))
            if num_prompts is not None and len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"{path} holds no prompt")
    return requests


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 64) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths vary uniformly within ±this share")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: own tokens")
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: prefixes")
    g.add_argument("--phrase-len", type=int, default=16,
                   help="repeated-phrase: tokens of the phrase each prompt repeats up to "
                        "--input-len")
    g.add_argument("--random-mm-images-per-prompt", type=int, default=1,
                   help="random-mm: images per prompt")
    g.add_argument("--random-mm-image-size", type=int, default=336,
                   help="random-mm: each image's side in pixels (square)")
    g.add_argument("--dataset-seed", type=int, default=0)


def build_requests(args: argparse.Namespace, tokenizer: Any,
                   model: str | None = None) -> list[SampleRequest]:
    """The workload's requests; `model` (a folder) gives random-mm its image placeholder."""
    if args.dataset == "random":
        return random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.dataset_seed)
    if args.dataset == "random-mm":
        from transformers import AutoConfig
        placeholder = getattr(AutoConfig.from_pretrained(model), "image_token_id", None)
        if placeholder is None:
            raise ValueError(f"--dataset random-mm needs a vision-language model; {model} "
                             "has no image_token_id")
        return random_mm_requests(tokenizer, placeholder, args.num_prompts, args.input_len,
                                  args.output_len, args.range_ratio,
                                  args.random_mm_images_per_prompt, args.random_mm_image_size,
                                  args.dataset_seed)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_len,
                                          args.suffix_len, args.num_prefixes, args.output_len,
                                          args.dataset_seed)
    if args.dataset == "repeated-phrase":
        return repeated_phrase_requests(tokenizer, args.num_prompts, args.input_len,
                                        args.phrase_len, args.output_len, args.dataset_seed)
    if not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    return jsonl_requests(args.dataset_path, tokenizer, args.output_len, args.num_prompts)


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's parameters, for the report."""
    keys = {"random": ("num_prompts", "input_len", "output_len", "range_ratio"),
            "random-mm": ("num_prompts", "input_len", "output_len", "range_ratio",
                          "random_mm_images_per_prompt", "random_mm_image_size"),
            "prefix-repetition": ("num_prompts", "prefix_len", "suffix_len", "num_prefixes",
                                  "output_len"),
            "repeated-phrase": ("num_prompts", "input_len", "phrase_len", "output_len"),
            "jsonl": ("dataset_path", "num_prompts", "output_len")}[args.dataset]
    return {"dataset": args.dataset, **{k: getattr(args, k) for k in keys},
            "seed": args.dataset_seed}


def workload_text(workload: dict[str, Any]) -> str:
    """'random: num_prompts=64, input_len=128, ...' from `describe`'s mapping."""
    rest = ", ".join(f"{k}={v}" for k, v in workload.items() if k != "dataset")
    return f"{workload.get('dataset', 'workload')}: {rest}"
