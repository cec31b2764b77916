"""Bad adapters: each is refused with an error that says what is wrong, and the engine goes on
serving the good ones."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from lora_reference import MAX_TOKENS, PROMPTS, save_adapter
from parity import assert_matches_hf
from runtime.llm import LLM
from runtime.lora import LoRARequest
from runtime.sampling_params import SamplingParams
from runtime.testing.tiny_model import build_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(lora_setup):
    base, _, _ = lora_setup
    return LLM(base, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2,
               max_lora_rank=8)


def bad_adapters(base: str, root) -> dict[str, tuple[LoRARequest, str]]:
    """name -> (request, a phrase its error must hold)."""
    high_rank = save_adapter(base, str(root / "r16"), 0, r=16, target_modules=["q_proj"])
    foreign = save_adapter(build_tiny_llama(str(root / "other"), hidden_size=32,
                                            intermediate_size=64),
                           str(root / "foreign"), 0, r=4, target_modules=["q_proj"])
    lacking = save_adapter(base, str(root / "lacking"), 0, r=4, target_modules=["q_proj"])
    config_file = os.path.join(lacking, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["target_modules"] = ["q_proj", "c_attn"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    return {"rank": (LoRARequest("r16", 11, high_rank), "rank 16 is above max_lora_rank 8"),
            "shape": (LoRARequest("foreign", 12, foreign), "another base model"),
            "modules": (LoRARequest("lacking", 13, lacking), "['c_attn']"),
            "folder": (LoRARequest("gone", 14, str(root / "nowhere")), "no folder at")}


def test_bad_adapters_are_refused_and_the_engine_serves_on(llm, lora_setup, tmp_path):
    _, requests, refs = lora_setup
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, (bad, phrase) in bad_adapters(lora_setup[0], tmp_path).items():
        with pytest.raises(ValueError, match="LoRA adapter") as error:
            llm.generate(prompts, GREEDY, use_tqdm=False,
                         lora_request=[requests["qv"], bad, None, None])
        assert phrase in str(error.value), name
    assert not llm.engine.has_unfinished_requests()
    assert_matches_hf(llm.generate(prompts, GREEDY, use_tqdm=False,
                                   lora_request=requests["qv"]), refs["qv"])


def test_lora_off_is_refused(lora_setup):
    base, requests, _ = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=requests["qv"])


def test_lora_request_count_must_match(llm, lora_setup):
    _, requests, _ = lora_setup
    with pytest.raises(ValueError, match="got 2 lora requests for 1 prompts"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=[requests["qv"], None])


def copy_adapter(source: str, path) -> str:
    shutil.copytree(source, path)
    return str(path)


def test_an_adapter_that_goes_bad_after_its_check_fails_only_its_requests(llm, lora_setup,
                                                                           tmp_path):
    """Checked, then corrupt by the time the worker reads it: its requests end with the error
    (finish_reason abort), the rest of the batch runs on; gone by then: refused when queued."""
    _, requests, refs = lora_setup
    corrupt = LoRARequest("corrupt", 21, copy_adapter(requests["all"].lora_path,
                                                      tmp_path / "corrupt"))
    llm.engine.processor.check_lora(corrupt)
    with open(os.path.join(corrupt.lora_path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    outputs = llm.generate(prompts * 3, GREEDY, use_tqdm=False,
                           lora_request=[requests["qv"]] * 2 + [corrupt] * 2 + [None] * 2)
    assert_matches_hf(outputs[:2], refs["qv"][:2])
    assert_matches_hf(outputs[4:], refs[None][:2])
    for out in outputs[2:4]:
        assert out.outputs[0].finish_reason == "abort"
        assert "LoRA adapter 'corrupt': cannot read" in out.outputs[0].stop_reason
        assert out.outputs[0].token_ids == []
    gone = LoRARequest("gone", 22, copy_adapter(requests["qv"].lora_path, tmp_path / "gone"))
    llm.engine.processor.check_lora(gone)
    shutil.rmtree(gone.lora_path)
    with pytest.raises(ValueError, match="LoRA adapter 'gone': no folder at"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=gone)
    assert not llm.engine.has_unfinished_requests()
    assert_matches_hf(llm.generate(prompts, GREEDY, use_tqdm=False,
                                   lora_request=requests["all"]), refs["all"][:2])
