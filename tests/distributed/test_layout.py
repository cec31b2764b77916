"""Rank layout, layer ranges and micro-batches: the arithmetic every rank must agree on."""
from __future__ import annotations

from runtime.distributed.layout import ParallelLayout, layer_range
from runtime.distributed.pipeline import PipelineStage
from runtime.worker.micro_batches import merge_outputs, micro_batches
from runtime.sampling_params import SamplingParams
from runtime.core.messages import ScheduledRequest, StepOutput


def test_groups_of_tp2_by_pp2():
    layout = ParallelLayout(tp_size=2, pp_size=2)
    assert layout.world_size == 4 and layout.output_rank == 2
    assert [layout.tp_group(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [layout.pp_group(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_layer_ranges_cover_every_layer_once():
    assert [layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [layer_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    stage = PipelineStage(rank=1, size=2)
    assert stage.owns("model.layers.3.mlp.down_proj.weight", 5)
    assert not stage.owns("model.layers.2.mlp.down_proj.weight", 5)
    assert stage.owns("lm_head.weight", 5) and stage.owns("model.norm.weight", 5)
    assert not stage.owns("model.embed_tokens.weight", 5)


def request(i: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(str(i), [0] * num_tokens, 0, [0], True, SamplingParams(), 0,
                            num_tokens, [0] * num_tokens)


def test_micro_batches_balance_tokens_and_keep_order():
    def split(sizes, n):
        requests = [request(i, k) for i, k in enumerate(sizes)]
        parts = micro_batches(requests, n)
        assert [r for p in parts for r in p] == requests
        return [[len(r.token_ids) for r in p] for p in parts]

    assert split([1, 1, 1, 1], 2) == [[1, 1], [1, 1]]
    assert split([10, 1, 1], 2) == [[10], [1, 1]]
    assert split([1, 1, 10], 2) == [[1, 1], [10]]
    assert split([5], 2) == [[5]]


def test_merge_outputs():
    a, b = StepOutput(sampled={"x": [1]}), StepOutput(sampled={"y": [2]}, logprobs={"y": []})
    merged = merge_outputs([a, b])
    assert merged.sampled == {"x": [1], "y": [2]} and merged.logprobs == {"y": []}
