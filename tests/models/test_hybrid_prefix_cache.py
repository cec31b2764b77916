"""Prefix caching for hybrid models: the recurrent state checkpointed at block ends lets a
request sharing a prefix resume from the deepest cached block, with transformers' greedy tokens
and logprobs; checkpoints go when their blocks leave the cache, and n > 1 siblings resume from
their leader's."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.models.test_hybrid_models import CASES
from tests.models.test_hybrid_models_more import CASES as MORE_CASES
from tests.parity import assert_matches_hf, hf_greedy

MAX_NEW = 6
BLOCK = 16
# a 70-token prefix (4 full blocks and 6 tokens) shared by prompts of different tails
PREFIX = [1] + list(range(400, 469))
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + list(range(900, 920)), PREFIX[:40] + [5, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["qwen3.5", "mamba2", "lfm2", "jamba"])
def case(request, tiny_model_factory):
    """(model folder, transformers' greedy references for PROMPTS); Jamba for Mamba 1."""
    arch, overrides = {**CASES, **MORE_CASES}[request.param]
    path = tiny_model_factory(arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(case) -> LLM:
    """A 24-token budget: prompts run in chunks that end mid-block."""
    return LLM(case[0], dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=24,
               block_size=BLOCK)


def test_shared_prefix_hits_and_matches_transformers(case, llm):
    """The first prompt checkpoints every block it completes; the second resumes at the last
    full block of the shared prefix (64 tokens), the third mid-block at its previous full
    block (32); each equals transformers."""
    outputs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 32]
    assert_matches_hf(outputs, case[1])


def test_parallel_samples_resume_from_the_leader(case, llm):
    """n = 3 samples: the siblings take the leader's checkpoint and equal three independent
    runs (seeded: the samples differ from each other)."""
    prompt = [1] + list(range(600, 650))  # no earlier prompt shares it
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_NEW, ignore_eos=True)
    kv = llm.engine.core.kv
    hits = kv.num_cache_hits
    together = llm.generate([prompt], params)[0]
    assert kv.num_cache_hits - hits == 2 * 48  # two siblings, from the leader's third block
    fresh = LLM(case[0], dtype="float32", kv_cache_memory="8MiB", block_size=BLOCK,
                enable_prefix_caching=False)
    alone = fresh.generate([prompt], params)[0]
    assert [s.token_ids for s in together.outputs] == [s.token_ids for s in alone.outputs]


def test_eviction_drops_checkpoints(case):
    """One sequence of at most 112 tokens: a cache of 7 blocks. A 100-token prompt takes them
    all, evicting the first prompt's blocks, and their checkpoints go with them: the first
    prompt again recomputes from its first token, and still matches."""
    path, references = case
    small = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=1,
                max_model_len=112, block_size=BLOCK)
    kv = small.engine.core.kv
    small.generate([PROMPTS[0]], GREEDY)
    first = set(kv.checkpoints.entry_of)
    assert len(first) == 4  # blocks 1-4 of its 73 tokens
    small.generate([list(range(2000, 2100))], GREEDY)
    assert len(kv.checkpoints) == 6 and not first & set(kv.checkpoints.entry_of)
    again = small.generate([PROMPTS[0]], GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert_matches_hf([again], references[:1])
