"""The LLM API end to end on a tiny model: sampling options, n > 1, logprobs, errors, aborts."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams

PROMPT = list(range(500, 540))  # 40 tokens: two full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", kv_cache_memory="16MiB")


def greedy(llm, prompt, n=8, **kw):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0].outputs[0]


def test_text_prompts_decode_to_their_tokens(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6,
                                                     ignore_eos=True))[0]
    assert out.prompt == "Hello there"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello there")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length"


def test_get_tokenizer_is_the_one_prompts_are_encoded_with(llm):
    ids = llm.get_tokenizer().encode("the cat sat", add_special_tokens=False)
    out = llm.generate(["the cat sat"], SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids[-len(ids):] == ids


def test_seeded_sampling_reproduces_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate([[3, 4, 5], PROMPT, [9] * 20], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone


def test_n_samples_differ_and_share_the_prompt_blocks(llm):
    engine = llm.engine
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    request_id = engine.add_request(PROMPT, params)
    engine.step()  # sample 0 computes the prompt; the others are released to share it
    engine.step()  # they are admitted, adopting its full prompt blocks
    leader, *siblings = [engine.core.scheduler.requests[f"{request_id}#{k}"] for k in range(4)]
    for sibling in siblings:
        assert sibling.block_ids[:2] == leader.block_ids[:2]
    pool = engine.core.kv.pool
    assert all(pool.blocks[b].ref_count == 4 for b in leader.block_ids[:2])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    samples = outputs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert engine.core.kv.num_free_blocks == engine.core.num_blocks


def test_stop_strings_and_stop_tokens(llm):
    base = greedy(llm, PROMPT, 12)
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    cut = greedy(llm, PROMPT, 12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    kept = greedy(llm, PROMPT, 12, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    token = greedy(llm, PROMPT, 12, stop_token_ids=[base.token_ids[3]])
    assert token.token_ids == base.token_ids[:4] and token.finish_reason == "stop"
    assert token.stop_reason == base.token_ids[3]


def test_min_tokens_holds_back_stop_tokens(llm):
    first = greedy(llm, PROMPT, 4).token_ids[0]
    assert greedy(llm, PROMPT, 4, stop_token_ids=[first]).token_ids == [first]
    held = greedy(llm, PROMPT, 4, stop_token_ids=[first], min_tokens=2)
    assert held.token_ids[0] != first and len(held.token_ids) >= 2


def test_logprobs_and_prompt_logprobs_match_transformers(llm, model_path):
    hf = transformers.LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + out.outputs[0].token_ids])
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        token = PROMPT[pos]
        assert abs(entry[token].logprob - ref[pos - 1, token].item()) < 2e-3
        assert len(entry) in (3, 4)  # the prompt token plus the top 2
    for step, entry in enumerate(out.outputs[0].logprobs):
        top = torch.topk(ref[len(PROMPT) - 1 + step], 3)
        assert list(entry)[0] == out.outputs[0].token_ids[step]
        assert entry[out.outputs[0].token_ids[step]].rank == 1
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[token].logprob - value) < 2e-3
    total = sum(entry[t].logprob for entry, t in zip(out.outputs[0].logprobs,
                                                       out.outputs[0].token_ids))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hi"}]
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3))[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected


def test_abort_frees_the_request_blocks(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.core.kv.num_free_blocks < engine.core.num_blocks
    final = engine.abort_request(request_id)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.core.kv.num_free_blocks == engine.core.num_blocks


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    ([10**6], SamplingParams(), "token ids must be in"),
    ([5] * 1024, SamplingParams(), "max_model_len"),
    ({"prompt_embeds": torch.zeros(2, 64)}, SamplingParams(), "enable_prompt_embeds=True"),
])
def test_bad_input_is_rejected_and_other_requests_survive(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, prompt], params)
    assert not llm.engine.has_unfinished_requests()
    assert len(greedy(llm, PROMPT, 3).token_ids) == 3


def test_bad_sampling_params_name_the_parameter():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_unknown_architecture_lists_the_supported_ones(model_path, tmp_path):
    for name in os.listdir(model_path):
        (tmp_path / name).write_bytes((open(os.path.join(model_path, name), "rb")).read())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]  # no native class, no fallback
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported .*: native classes: .*LlamaForCausalLM"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
