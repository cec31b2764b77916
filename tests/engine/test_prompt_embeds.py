"""Prompts given as embeddings (enable_prompt_embeds): a tiny Llama's own embeddings of a
prompt's token ids give the token ids' greedy tokens and logprobs (and transformers'), share
the prefix cache only with equal embeddings, survive preemption, and what cannot be served is
refused by name."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, BeamSearchParams, SamplingParams
from tests.parity import LOGPROB_ATOL, assert_matches_hf, hf_greedy

PROMPTS = [list(range(500, 540)), [1, 504, 3458, 282, 4649, 314]]  # 40 tokens (2.5 blocks), 6


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def hf_model(model_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_path):
    # a step of 32 tokens: the 40-token prompt is prefilled in two chunks
    return LLM(model_path, dtype="float32", kv_cache_memory="16MiB", enable_prompt_embeds=True,
               max_num_batched_tokens=32)


def embeds_of(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.get_input_embeddings()(torch.tensor(ids)).clone()


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **kw)


def test_embeddings_of_the_prompt_give_its_tokens_and_logprobs(llm, hf_model):
    prompts = [{"prompt_embeds": embeds_of(hf_model, ids)} for ids in PROMPTS]
    # one batch mixing both kinds: the embeddings prompts' rows and the ids' own embeddings
    outputs = llm.generate(prompts + PROMPTS, greedy())
    assert_matches_hf(outputs[:2], [hf_greedy(hf_model, ids, 8) for ids in PROMPTS])
    for by_embeds, by_ids in zip(outputs[:2], outputs[2:]):
        assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
        worst = max(abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
                    for a, b in zip(by_embeds.outputs[0].logprobs, by_ids.outputs[0].logprobs))
        assert worst < LOGPROB_ATOL
    assert outputs[0].prompt_token_ids == []  # it has none: its ids are placeholders
    assert outputs[0].prompt is None


def test_prefix_cache_is_shared_by_equal_embeddings_only(llm, hf_model):
    ids = list(range(600, 640))
    embeds = embeds_of(hf_model, ids)
    first = llm.generate({"prompt_embeds": embeds}, greedy(2))[0]
    again = llm.generate({"prompt_embeds": embeds.clone()}, greedy(2))[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    other = embeds.clone()
    other[3] += 0.5  # a different fourth row: its first block differs
    assert llm.generate({"prompt_embeds": other}, greedy(2))[0].num_cached_tokens == 0
    # the placeholders' token ids never hit the embeddings' blocks
    assert llm.generate([[0] * 40], greedy(2))[0].num_cached_tokens == 0


def test_preempted_requests_recompute_from_their_embeddings(model_path, hf_model):
    # 12 blocks of 16 tokens: four 40 + 40-token requests cannot all run, so some are
    # preempted and recomputed from their prompt embeddings and the tokens they generated
    llm = LLM(model_path, dtype="float32", kv_cache_memory="96KiB", enable_prompt_embeds=True,
              enable_prefix_caching=False)
    prompts = [list(range(700 + 50 * k, 740 + 50 * k)) for k in range(4)]
    outputs = llm.generate([{"prompt_embeds": embeds_of(hf_model, ids)} for ids in prompts],
                           greedy(40))
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches_hf(outputs, [hf_greedy(hf_model, ids, 40) for ids in prompts])


def test_a_family_that_scales_its_embeddings_scales_given_ones_too(tiny_model_factory):
    """As transformers' inputs_embeds: rows of the embedding table, which Granite multiplies
    by embedding_multiplier (Gemma by sqrt(hidden)) after, as it does its own."""
    path = tiny_model_factory("GraniteForCausalLM", embedding_multiplier=6.0,
                              attention_multiplier=0.2, residual_multiplier=0.4,
                              logits_scaling=4.0, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", enable_prompt_embeds=True)
    outputs = llm.generate([{"prompt_embeds": embeds_of(hf, ids)} for ids in PROMPTS], greedy())
    assert_matches_hf(outputs, [hf_greedy(hf.eval(), ids, 8) for ids in PROMPTS])


@pytest.mark.parametrize("tensor, message", [
    (torch.zeros(4, 32), "hidden size 64, got 32"),
    (torch.zeros(2, 4, 64), "must be 2-D"),
    (torch.zeros(0, 64), "is empty"),
    (torch.zeros(4, 64, dtype=torch.float64), "float32, bfloat16 or float16, got float64"),
    (torch.full((4, 64), float("nan")), "not finite"),
    (torch.zeros(2048, 64), "max_model_len"),
    ([[0.0] * 64], "must be a torch.Tensor"),
])
def test_tensors_that_do_not_fit_are_refused(llm, tensor, message):
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_embeds": tensor}, greedy())


def test_what_an_embeddings_prompt_cannot_give_is_refused(llm, hf_model):
    embeds = embeds_of(hf_model, PROMPTS[1])
    with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
        llm.generate({"prompt_embeds": embeds}, greedy(prompt_logprobs=0))
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt_embeds": embeds}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_the_flag_is_refused_where_it_cannot_run(tiny_model_factory, model_path):
    with pytest.raises(ValueError, match="not supported for BertModel"):
        LLM(tiny_model_factory("BertModel"), enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        LLM(model_path, enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
