"""Expert parallel (`enable_expert_parallel`): the tensor-parallel ranks split the MoE experts
whole instead of slicing every expert, and the same greedy tokens and logprobs come out as on
one rank and from transformers."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.cli.main import build_parser
from runtime.layers.build_context import BuildContext
from runtime.layers.fused_moe import FusedMoE
from runtime.plugins.ops import fused_moe
from tests.models.test_native_models import CASES
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 8
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", num_threads=1)


class Unreduced:
    """A tensor-parallel group whose all-reduce leaves each rank's partial sum, so one process
    can hold both ranks' layers and add their outputs itself."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_each_rank_holds_its_experts_whole_and_the_ranks_sum_to_the_full_layer():
    torch.manual_seed(0)
    experts, hidden, inter = 4, 16, 8
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x, logits = torch.randn(7, hidden), torch.randn(7, experts)
    outputs = []
    for rank in range(2):
        ctx = BuildContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=None,
                           tp_rank=rank, tp_size=2, tp_group=Unreduced(), ep_size=2)
        layer = FusedMoE(experts, 2, hidden, inter, True, ctx)
        assert layer.w13_weight.shape == (2, 2 * inter, hidden)
        for e in range(experts):
            layer.load_expert(layer.w13_weight, w13[e, :inter], e, "gate")
            layer.load_expert(layer.w13_weight, w13[e, inter:], e, "up")
            layer.load_expert(layer.w2_weight, w2[e], e, "down")
        torch.testing.assert_close(layer.w13_weight.data, w13[2 * rank:2 * rank + 2])
        outputs.append(layer(x, logits))
    weights, ids = torch.softmax(logits, -1).topk(2, -1)
    want = fused_moe(x, w13, w2, weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(outputs[0] + outputs[1], want, rtol=1e-5, atol=1e-5)
    assert outputs[0].abs().sum() > 0 and outputs[1].abs().sum() > 0


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_expert_parallel_matches_one_rank_and_transformers(case, tiny_model_factory):
    arch, overrides = CASES[case]
    path = tiny_model_factory(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    prompts = PROMPTS[:3]
    single = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(prompts, params)]
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == single
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(outputs, [hf_greedy(hf, p, MAX_NEW) for p in prompts])


def test_experts_not_divisible_by_the_ranks_are_refused_before_any_worker_starts(
        tiny_model_factory):
    path = tiny_model_factory("MixtralForCausalLM", num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"3 experts .* allowed: \[1\]"):
        LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)


def test_the_flag_takes_vllms_names():
    parse = build_parser().parse_args
    assert parse(["generate", "x", "--enable-expert-parallel"]).enable_expert_parallel
    assert parse(["generate", "x", "-ep"]).enable_expert_parallel
    assert not parse(["generate", "x"]).enable_expert_parallel
