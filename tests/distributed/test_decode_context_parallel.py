"""Decode context parallel: the interleave rule, the backends' partial attention with LSE over a
shard merging to full attention, and the engine at tp=2 dcp=2 and tp=4 dcp=4 (gloo, one process per rank)
giving the same greedy tokens and logprobs as one rank, with chunked prefill and a forced
preemption; what it cannot run is refused with the reason."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from runtime.attention_backends.base import AttentionMetadata
from runtime.attention_backends.context_parallel import ContextParallel, merge_attn_states
from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.config import EngineConfig
from runtime.distributed.layout import ParallelLayout, check_decode_context_parallel
from runtime.model_spec import ModelSpec
from runtime.models.registry import choose_model
from runtime.testing.paged_batch import build_layer, in_layout
from tests.parity import LOGPROB_ATOL, PROMPTS, assert_matches_hf, hf_greedy


@pytest.fixture(scope="module")
def cpu_kernels():
    from runtime.platforms.cpu.platform import CpuPlatform
    failed = CpuPlatform().kernel_build_error()
    if failed:
        pytest.skip(f"the CPU kernels did not build: {failed}")


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (4, 2)])
def test_interleave_rule(world, interleave):
    positions = torch.arange(97)
    rules = [ContextParallel(r, world, interleave) for r in range(world)]
    owner = rules[0].owner(positions)
    assert owner.tolist() == [(p // interleave) % world for p in range(97)]
    for cp in rules:
        mine = positions[owner == cp.rank]
        local = cp.local_index(mine)
        assert local.tolist() == list(range(len(mine)))  # a rank's shard is contiguous
        assert cp.positions(local).tolist() == mine.tolist()
        lens = torch.arange(97)
        assert cp.local_len(lens).tolist() == [int((owner[:n] == cp.rank).sum()) for n in lens]


def test_groups_are_consecutive_ranks_of_a_tensor_parallel_group():
    layout = ParallelLayout(tp_size=4, pp_size=2, dcp_size=2)
    assert [layout.dcp_group(r) for r in range(8)] == [[0, 1], [0, 1], [2, 3], [2, 3],
                                                       [4, 5], [4, 5], [6, 7], [6, 7]]
    assert [layout.dcp_rank(r) for r in range(8)] == [0, 1] * 4


def reference(query, keys, values, query_lens, seq_lens, scale, window):
    """Causal attention of each request's new tokens over its whole context, in float32."""
    out, start = [], 0
    for q_len, seq_len, k, v in zip(query_lens, seq_lens, keys, values):
        q = query[start:start + q_len]
        start += q_len
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        group = q.size(1) // k.size(1)
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, v.repeat_interleave(group, 1)))
    return torch.cat(out)


def shard(cp: ContextParallel, keys, values, query_lens, seq_lens, block_size, num_blocks):
    """This rank's cache (token-major) holding its share of every context before the step, and
    the step's metadata: each request's table is blocks 5i.. of every rank's cache."""
    num_kv_heads, head_size = keys[0].shape[1:]
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    tables = torch.tensor([[5 * i + b for b in range(5)] for i in range(len(seq_lens))],
                          dtype=torch.int32)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(seq_len)
        local = cp.local_index(pos)
        slot = tables[i, local // block_size].long() * block_size + local % block_size
        slot[cp.owner(pos) != cp.rank] = -1
        old = slot[:seq_len - q_len]
        kept = old >= 0
        cache[0].view(-1, num_kv_heads, head_size)[old[kept]] = keys[i][:seq_len - q_len][kept]
        cache[1].view(-1, num_kv_heads, head_size)[old[kept]] = values[i][:seq_len - q_len][kept]
        slots.append(slot[seq_len - q_len:])
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        num_decode_tokens=sum(q == 1 for q in query_lens), dcp=cp)
    return cache, metadata


@pytest.mark.parametrize("backend", [TorchPagedAttention, CpuPagedAttention])
@pytest.mark.parametrize("world,interleave,window", [(2, 1, None), (4, 2, None), (4, 1, 7)])
def test_partials_merge_to_full_attention(backend, world, interleave, window, request):
    """Decodes (one with a context shorter than the group, so some ranks hold none of it), a
    chunk after a cached prefix and a whole prompt: each rank's partials with LSE over its
    shard merge to attention over the whole context, and each rank writes only its tokens."""
    if backend is CpuPagedAttention:
        request.getfixturevalue("cpu_kernels")
    query_lens, seq_lens = [1, 1, 1, 5, 9], [23, 2, 40, 30, 9]
    heads, kv_heads, head_size, block_size = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(n, kv_heads, head_size, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_size, generator=gen) for n in seq_lens]
    query = torch.randn(sum(query_lens), heads, head_size, generator=gen)
    key = torch.cat([k[n - q:] for k, q, n in zip(keys, query_lens, seq_lens)])
    value = torch.cat([v[n - q:] for v, q, n in zip(values, query_lens, seq_lens)])
    scale = head_size ** -0.5
    outs, lses = [], []
    for rank in range(world):
        cp = ContextParallel(rank, world, interleave)
        cache, metadata = shard(cp, keys, values, query_lens, seq_lens, block_size, 25)
        layer = build_layer(backend, "cpu", heads, head_size, scale, kv_heads, window)
        stored = in_layout(backend, cache)
        out, lse = layer.forward_with_lse(query, key, value, stored, metadata)
        outs.append(out)
        lses.append(lse)
        full, _ = shard(cp, keys, values, [0] * 5, seq_lens, block_size, 25)  # all written
        assert torch.equal(stored, in_layout(backend, full))
    merged = merge_attn_states(torch.stack(outs), torch.stack(lses))
    expected = reference(query, keys, values, query_lens, seq_lens, scale, window)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    # the decode of 2 tokens: ranks 2 and 3 at world 4 hold none of it
    assert not torch.isnan(torch.stack(outs)).any()


MAX_NEW = 12
# 4 query heads on 1 KV head: tensor parallel replicates the KV head, which DCP splits.
MODEL = dict(num_attention_heads=4, num_key_value_heads=1)
# K and V x 2 layers x 16 tokens x 1 KV head x head size 16 x 4 bytes (float32), per rank
BLOCK_BYTES = 2 * 2 * 16 * 16 * 4
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, num_threads=1, max_model_len=128)


@pytest.fixture(scope="module")
def one_rank(tiny_model_factory):
    path = tiny_model_factory("LlamaForCausalLM", **MODEL)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    llm = LLM(path, kv_cache_memory="1MiB", **ENGINE)
    return path, params, llm.generate(PROMPTS, params)


@pytest.mark.parametrize("tp,dcp,interleave", [(2, 2, 1), (4, 4, 2)])
def test_matches_one_rank(tp, dcp, interleave, one_rank, caplog):
    """dcp 2: 6 blocks of 32 tokens, too few for every prompt at once, so requests are
    preempted and recomputed; dcp 4: 2 blocks of 64, every context split four ways. 16-token
    steps cut the prompts into chunks that start inside blocks."""
    path, params, single = one_rank
    blocks = {2: 6, 4: 2}[dcp]
    with caplog.at_level(logging.INFO, logger="runtime.engine.core"):
        llm = LLM(path, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                  cp_kv_cache_interleave_size=interleave, kv_cache_memory=blocks * BLOCK_BYTES,
                  **ENGINE)
    try:
        outputs = llm.generate(PROMPTS, params)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0 or dcp == 4, "the cache was meant to be " \
            "too small"
        assert core.kv.block_size == 16 * dcp
    finally:
        llm.engine.core.shutdown()
    assert f"KV cache: {blocks} blocks of {16 * dcp} tokens ({blocks * 16 * dcp} tokens (x {dcp} " \
           "with decode context parallel)" in caplog.text
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
    for ours, theirs in zip(outputs, single):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) \
                < LOGPROB_ATOL
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(outputs, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS])


def test_refused_with_the_reason(tiny_model_factory):
    with pytest.raises(ValueError, match=r"decode_context_parallel_size 3 must divide "
                                         r"tensor_parallel_size 4 .*allowed: \[1, 2, 4\]"):
        EngineConfig(tensor_parallel_size=4, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size 3 must divide block_size"):
        EngineConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                     cp_kv_cache_interleave_size=3)
    with pytest.raises(ValueError, match="does not run speculative decoding"):
        EngineConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not run with a KV connector"):
        EngineConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                     kv_offloading_size=0.1)
    # 2 KV heads at tp 2: one per rank, no copy for DCP to split
    path = tiny_model_factory("LlamaForCausalLM")
    with pytest.raises(ValueError, match="must divide tensor_parallel_size / num_kv_heads .*"
                                         "a multiple of 4"):
        LLM(path, tensor_parallel_size=2, decode_context_parallel_size=2)
    config = EngineConfig(model=path, tensor_parallel_size=2, decode_context_parallel_size=2)
    model = ModelSpec.resolve(config).model_config
    layout = ParallelLayout.of(config)
    for change, reason in [(dict(attention_kind="mla"), "not built for MLA"),
                           (dict(attention_sinks=True), "does not merge attention sinks"),
                           (dict(choice=choose_model(["BambaForCausalLM"])),
                            "does not split .* recurrent layers")]:
        with pytest.raises(ValueError, match=reason):
            check_decode_context_parallel(dataclasses.replace(model, **change), layout)
