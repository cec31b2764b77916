"""A request re-admitted with the tokens it had generated (as the server does when its engine
core died) goes on with exactly the tokens of an undisturbed run: greedy, seeded (the
generator is re-seeded from the output position), with penalties, n > 1 samples, and under a
grammar (its matcher advanced over the generated tokens)."""
from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.request import Request
from runtime.structured_output.params import StructuredOutputsParams

PROMPT = "The history of the city"
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True,
                                frequency_penalty=0.5, repetition_penalty=1.2),
    "grammar": SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                              structured_outputs=StructuredOutputsParams(regex=r"[0-9]{6,40}")),
}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory(), dtype="float32", kv_cache_memory="16MiB")


def _resume(llm: LLM, prompt_ids: list[int], params: SamplingParams, sample_index: int,
            generated: list[int]) -> list[int]:
    """Run one sample in the core from `generated` on, to its end; its tokens after them."""
    core = llm.engine.core
    request_id = f"resumed-{len(generated)}-{sample_index}"
    max_tokens = params.max_tokens
    core.add_request(Request(request_id, prompt_ids, params, max_tokens,
                             sample_index=sample_index, output_token_ids=generated))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            assert out.finish_reason != "abort", out
    return tokens


@pytest.mark.parametrize("name", list(PARAMS))
def test_readmitted_request_ends_with_the_undisturbed_tokens(llm, name):
    params = PARAMS[name]
    (out,) = llm.generate([PROMPT], params)
    prompt_ids, full = out.prompt_token_ids, out.outputs[0].token_ids
    assert len(full) > 4
    for k in (1, len(full) // 2, len(full) - 1):
        assert full[:k] + _resume(llm, prompt_ids, params, 0, full[:k]) == full, (name, k)


def test_each_sample_of_n_resumes_from_its_own_tokens(llm):
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    samples = [o.token_ids for o in out.outputs]
    assert samples[0] != samples[1]
    for index, full in enumerate(samples):
        assert full[:5] + _resume(llm, out.prompt_token_ids, params, index, full[:5]) == full
