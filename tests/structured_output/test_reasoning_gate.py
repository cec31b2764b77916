"""The engine core's structured-output manager under a reasoning parser's markers: unconstrained
while the request reasons, the grammar fed only what follows the end marker, proposals cut
before it, and a prompt that closed the thinking constrained from the first token."""
from __future__ import annotations

import pytest

from runtime.core.structured_output import StructuredOutputManager, reasoning_ended
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from runtime.structured_output.params import StructuredOutputsParams

START, END = 10, 11  # any two tokens of the vocabulary serve as the markers here


def test_the_last_marker_decides():
    assert not reasoning_ended([1, 2], START, END)
    assert reasoning_ended([1, START, 5, END, 6], START, END)
    assert not reasoning_ended([START, END, 4, START, 5], START, END)  # a new turn thinks


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def manager(tokenizer):
    from runtime.structured_output.backends import make_compiler
    manager = StructuredOutputManager(
        lambda: make_compiler("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id]))
    yield manager
    manager.shutdown()


def ready(manager: StructuredOutputManager, prompt: list[int]) -> Request:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                            _reasoning_token_ids=(START, END))
    request = Request(f"r{len(manager.matchers)}", prompt, params, 8)
    manager.add_request(request)
    manager.wait(60)
    assert manager.take_ready() == ([request], [])
    return request


def test_the_grammar_starts_after_the_end_marker(manager, tokenizer):
    yes, bad = tokenizer.encode("yes")[0], tokenizer.encode("zzz")[0]
    request = ready(manager, [1, 2])
    step = [(request, 1)]
    assert manager.bitmask(step) == (None, {})  # reasoning: nothing masked
    sampled = {request.request_id: [bad, bad]}
    assert manager.accept(step, sampled) == {} and sampled[request.request_id] == [bad, bad]
    request.all_token_ids += [bad, bad]
    request.num_computed_tokens = request.num_tokens - 1
    request.spec_token_ids = [5, END, 7]
    manager.advance(step)
    assert request.spec_token_ids == [5]  # proposals stop before the end marker
    request.spec_token_ids = []
    sampled = {request.request_id: [END, yes]}  # the grammar reads only what follows END
    assert manager.accept(step, sampled) == {} and request.request_id not in manager.reasoning
    request.all_token_ids += [END, yes]
    request.num_computed_tokens = request.num_tokens - 1
    mask, rows = manager.bitmask(step)
    assert rows == {request.request_id: 0} and mask is not None
    refused = {request.request_id: [bad]}
    assert request.request_id in manager.accept(step, refused)
    assert refused[request.request_id] == []


def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(manager, tokenizer):
    request = ready(manager, [1, START, END])
    assert request.request_id not in manager.reasoning
    mask, rows = manager.bitmask([(request, 3)])
    assert rows == {request.request_id: 0} and mask is not None
    sampled = {request.request_id: [END]}  # the marker itself is no answer to the grammar
    assert request.request_id in manager.accept([(request, 3)], sampled)
    assert sampled[request.request_id] == []
