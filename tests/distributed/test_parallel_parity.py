"""Tensor and pipeline parallel on the CPU (gloo, one worker process per rank, one thread each):
the same greedy tokens as one rank, and logprobs as close to transformers as one rank's."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.models.test_native_models import CASES as NATIVE
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 12
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=64,
              num_threads=1)

# (architecture, model overrides, tp, pp): each case splits the model a different way.
CASES = {
    # 2 KV heads: one per rank.
    "tp2": ("LlamaForCausalLM", {}, 2, 1),
    # 3 layers: stages of 2 and 1; tied embeddings: the last stage loads the LM head from the
    # embedding it does not hold; biased QKV.
    "pp2-qwen2-tied": ("Qwen2ForCausalLM", dict(num_hidden_layers=3, tie_word_embeddings=True),
                       1, 2),
    # 1 KV head, replicated on both tensor-parallel ranks of each stage; 4 processes.
    "tp2xpp2-one-kv-head": ("LlamaForCausalLM", dict(num_key_value_heads=1), 2, 2),
    # the native families: stage 0 a sliding layer, stage 1 a global one (Gemma); the final
    # soft-cap on the last stage only; fused checkpoint tensors split on either stage (Phi-3);
    # experts loaded only by the stage holding their layer (Qwen3-MoE)
    **{f"pp2-{case}": (*NATIVE[case], 1, 2) for case in ("gemma2", "gemma3", "phi3",
                                                        "qwen3-moe")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_matches_one_rank(case, tiny_model_factory):
    arch, overrides, tp, pp = CASES[case]
    path = tiny_model_factory(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    single = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params)]

    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        outputs = llm.generate(PROMPTS, params)
    finally:
        llm.engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == single
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(outputs, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS])
