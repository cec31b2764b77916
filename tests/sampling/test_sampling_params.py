import dataclasses

import pytest

from runtime.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, None, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.logprobs, p.prompt_logprobs, p.ignore_eos, p.include_stop_str_in_output) == (None, None, False, False)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.greedy


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6] and p.top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_eos_and_stop_token_ids():
    p = SamplingParams(stop_token_ids=[7])
    assert p.all_stop_token_ids == {7}
    q = p.with_eos(2)
    assert q.all_stop_token_ids == {2, 7} and q.eos_token_id == 2
    assert p.eos_token_id is None  # with_eos copies
    assert q.clone(ignore_eos=True).all_stop_token_ids == {7}
    assert dataclasses.replace(q, temperature=0.5).eos_token_id == 2
    assert "_eos_token_id" not in repr(q)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone(n=1, seed=3)
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and q.seed == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), r"n must be an integer >= 1, got 0"),
    (dict(n=2, best_of=1), r"best_of must be >= n, got best_of=1 and n=2"),
    (dict(best_of=3, temperature=0), r"best_of must be 1 with greedy sampling"),
    (dict(temperature=-0.1), r"temperature must be >= 0, got -0.1"),
    (dict(temperature=float("nan")), r"temperature must be >= 0, got nan"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), r"top_k must be -1 or 0 \(off\) or an integer >= 1, got -2"),
    (dict(top_k=2.5), r"top_k must be .*, got 2.5"),
    (dict(min_p=1.1), r"min_p must be in \[0, 1\], got 1.1"),
    (dict(seed="x"), r"seed must be an integer or None, got 'x'"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0, got 0.0"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
    (dict(min_tokens=-1), r"min_tokens must be an integer >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be <= max_tokens \(4\), got 5"),
    (dict(logprobs=MAX_LOGPROBS + 1), rf"logprobs must be None or an integer in \[0, {MAX_LOGPROBS}\], got 21"),
    (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or an integer in \[0, 20\], got -1"),
    (dict(stop=["ok", ""]), r"stop must hold non-empty strings, got ''"),
    (dict(stop="x", detokenize=False), r"stop strings need detokenize=True"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must hold integers >= 0, got -1"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_edges():
    SamplingParams(temperature=0, top_p=1, top_k=1, min_p=1, presence_penalty=-2, frequency_penalty=2,
                   max_tokens=1, min_tokens=1, logprobs=0, prompt_logprobs=MAX_LOGPROBS, n=2)
    SamplingParams(n=2, best_of=3)
    SamplingParams(max_tokens=None, min_tokens=1000)
