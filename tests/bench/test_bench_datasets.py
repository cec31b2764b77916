"""Workload generation: lengths, valid token ids, shared prefixes, JSONL."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from runtime.bench.datasets import (add_dataset_args, build_requests, jsonl_requests, lengths,
                                    prefix_repetition_requests, random_mm_requests,
                                    random_requests, repeated_phrase_requests)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_lengths_stay_in_range():
    rng = np.random.default_rng(0)
    values = lengths(100, 0.25, 500, rng)
    assert min(values) >= 75 and max(values) <= 125 and len(set(values)) > 10
    assert lengths(7, 0.0, 3, rng) == [7, 7, 7]
    with pytest.raises(ValueError, match="range_ratio"):
        lengths(10, 1.5, 1, rng)


def test_random_prompts_have_the_asked_lengths_and_valid_ids(tokenizer):
    requests = random_requests(tokenizer, 8, 32, 16, range_ratio=0.5, seed=3)
    special = set(tokenizer.all_special_ids)
    assert len(requests) == 8
    for r in requests:
        assert 16 <= len(r.prompt_token_ids) <= 48 and 8 <= r.output_len <= 24
        assert all(0 <= t < len(tokenizer) and t not in special for t in r.prompt_token_ids)
        assert r.prompt
    assert random_requests(tokenizer, 8, 32, 16, 0.5, seed=3) == requests  # seeded
    fixed = random_requests(tokenizer, 4, 20, 5)
    assert [len(r.prompt_token_ids) for r in fixed] == [20] * 4
    assert [r.output_len for r in fixed] == [5] * 4


def test_random_mm_prompts_open_with_their_images_placeholders(tokenizer):
    placeholder = len(tokenizer)  # no random token is it
    requests = random_mm_requests(tokenizer, placeholder, 4, 16, 8, 0.0, images_per_prompt=2,
                                  image_size=64, seed=1)
    for r in requests:
        assert r.prompt_token_ids[:2] == [placeholder] * 2
        assert placeholder not in r.prompt_token_ids[2:]
        assert len(r.prompt_token_ids) == 18 and [side for _, side in r.images] == [64, 64]
    seeds = [seed for r in requests for seed, _ in r.images]
    assert len(set(seeds)) == len(seeds)  # every image its own pixels


def test_prefix_repetition_shares_prefixes(tokenizer):
    requests = prefix_repetition_requests(tokenizer, 12, prefix_len=24, suffix_len=6,
                                          num_prefixes=3, output_len=4)
    assert len(requests) == 12
    prefixes = [tuple(r.prompt_token_ids[:24]) for r in requests]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 4 for p in set(prefixes))
    assert all(len(r.prompt_token_ids) == 30 for r in requests)
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_requests(tokenizer, 2, 8, 2, 3, 4)


def test_jsonl_prompts(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there"}) + "\n\n"
                    + json.dumps({"prompt": "Bye", "output_len": 3}) + "\n")
    requests = jsonl_requests(str(path), tokenizer, output_len=9)
    assert [r.output_len for r in requests] == [9, 3]
    assert requests[0].prompt_token_ids == tokenizer.encode("Hello there")
    assert len(jsonl_requests(str(path), tokenizer, 9, num_prompts=1)) == 1
    path.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        jsonl_requests(str(path), tokenizer, 9)


def test_build_requests_from_flags(tokenizer):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(["--dataset", "prefix-repetition", "--num-prompts", "4",
                              "--prefix-len", "8", "--suffix-len", "2", "--num-prefixes", "2",
                              "--output-len", "3"])
    assert [len(r.prompt_token_ids) for r in build_requests(args, tokenizer)] == [10] * 4
    with pytest.raises(ValueError, match="dataset-path"):
        build_requests(parser.parse_args(["--dataset", "jsonl"]), tokenizer)


def test_repeated_phrase_prompts_repeat_their_own_phrase(tokenizer):
    requests = repeated_phrase_requests(tokenizer, 3, 20, 6, 8, seed=1)
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == 20 and r.output_len == 8
        assert ids[6:12] == ids[:6] and ids[18:] == ids[:2]
    assert requests[0].prompt_token_ids[:6] != requests[1].prompt_token_ids[:6]
    with pytest.raises(ValueError, match="phrase_len"):
        repeated_phrase_requests(tokenizer, 1, 4, 8, 8)
