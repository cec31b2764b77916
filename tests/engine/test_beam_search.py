"""Beam search against transformers' (num_beams, length_penalty, early_stopping, do_sample=False)
on a tiny model whose end-of-sequence token is one it readily produces, so beams do finish early."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, BeamSearchParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1] + list(range(300, 337)), [1, 77, 88]]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory())
    best = plain.generate(torch.tensor([PROMPTS[0]]), num_beams=3, max_new_tokens=3,
                          do_sample=False, pad_token_id=0)
    eos = int(best[0, -1])  # a token the best beam produces: beams will end with it
    return tiny_model_factory(eos_token_id=eos)


@pytest.fixture(scope="module")
def hf(model_path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", kv_cache_memory="16MiB")


def hf_beams(model, prompt, width, max_tokens, length_penalty, early_stopping):
    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos, length_penalty=length_penalty,
                         early_stopping=early_stopping, output_scores=True,
                         return_dict_in_generate=True)
    beams = []
    for seq in out.sequences[:, len(prompt):].tolist():
        beams.append(seq[:seq.index(eos) + 1] if eos in seq else seq)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,length_penalty,early_stopping", [
    (2, 1.0, False), (3, 0.0, True), (3, 2.0, "never"), (4, -1.0, False)])
def test_beam_search_equals_transformers(llm, hf, width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ours = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, result in zip(PROMPTS, ours):
        beams, scores = hf_beams(hf, prompt, width, 8, length_penalty, early_stopping)
        assert [s.tokens for s in result.sequences] == beams
        assert [s.score for s in result.sequences] == pytest.approx(scores, abs=1e-3)
    pool = llm.engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_some_beams_end_with_eos(llm, hf):
    eos = hf.generation_config.eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    sequences = [s for r in llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
                 for s in r.sequences]
    assert any(s.finish_reason == "stop" and s.tokens[-1] == eos for s in sequences)
    assert all(s.text == llm.tokenizer.decode(s.tokens, skip_special_tokens=True)
               for s in sequences)


def test_beams_share_the_prompt_blocks(llm):
    prompt = list(range(500, 540))  # two full blocks
    before = llm.engine.core.kv.num_cache_hits
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=3))
    # steps 2 and 3 run 4 beams each, all served the prompt's 2 full blocks from the cache
    assert llm.engine.core.kv.num_cache_hits - before >= 2 * 4 * 2 * 16


@pytest.mark.parametrize("kwargs,message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be"),
])
def test_bad_beam_search_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_too_wide_a_beam_is_refused(llm):
    with pytest.raises(ValueError, match="beam_width <= 10"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=2))
