"""Chunked attention (Llama 4's `attention_chunk_size`): each backend that declares it against a
dense reference that masks every key outside the query's chunk; backends that do not declare it
refuse it."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.platforms.cpu import kernels
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.testing.paged_batch import build_layer, in_layout, make_batch

# decodes on either side of chunk edges (chunk 8: positions 7, 8, 16, 23), then prefill chunks
# that start mid-chunk and span several chunks
QUERY_LENS = [1, 1, 1, 1, 1, 5, 13]
SEQ_LENS = [8, 9, 17, 24, 1, 11, 30]
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 32


def dense_reference(batch, chunk: int) -> torch.Tensor:
    """Each request's whole context gathered from the cache (earlier tokens) and the step's new
    K/V, attended with an explicit mask: causal and within the query's chunk."""
    query, key, value, kv_cache, md = batch
    block_size = kv_cache.size(2)
    out = torch.empty_like(query)
    for i in range(md.num_reqs):
        lo, hi = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        seq_len = md.seq_lens_cpu[i]
        context = seq_len - (hi - lo)
        slots = [int(md.block_tables[i, p // block_size]) * block_size + p % block_size
                 for p in range(context)]
        k = torch.cat([kv_cache[0].flatten(0, 1)[slots], key[lo:hi]])
        v = torch.cat([kv_cache[1].flatten(0, 1)[slots], value[lo:hi]])
        k, v = (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (k, v))
        q_pos = torch.arange(context, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        mask = (k_pos <= q_pos) & (k_pos >= q_pos // chunk * chunk)
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi], k) * HEAD_SIZE ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def run_chunked(backend_cls, batch, chunk: int) -> torch.Tensor:
    query, key, value, kv_cache, md = batch
    impl = build_layer(backend_cls, query.device, HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                       attention_chunk_size=chunk)
    return impl.forward(query, key, value, in_layout(backend_cls, kv_cache), md)


def test_portable_backend_matches_the_dense_reference():
    batch = make_batch(QUERY_LENS, SEQ_LENS, 4, HEADS, KV_HEADS, HEAD_SIZE, seed=1)
    torch.testing.assert_close(run_chunked(TorchPagedAttention, batch, 8),
                               dense_reference(batch, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(kernels.load(CpuPlatform().info.model_name) is not None,
                    reason="the CPU kernels did not build")
@pytest.mark.parametrize("chunk", [8, 6])  # 8: the kernel over the last chunk; 6: portable
def test_cpu_backend_matches_the_dense_reference(chunk):
    batch = make_batch(QUERY_LENS, SEQ_LENS, 4, HEADS, KV_HEADS, HEAD_SIZE, seed=2)
    torch.testing.assert_close(run_chunked(CpuPagedAttention, batch, chunk),
                               dense_reference(batch, chunk), atol=1e-5, rtol=1e-5)


def test_triton_backend_matches_the_dense_reference():
    triton = pytest.importorskip("triton")
    if torch.cuda.is_available() or not triton.knobs.runtime.interpret:
        pytest.skip("runs the kernel through Triton's interpreter (TRITON_INTERPRET=1), no GPU")
    from runtime.attention_backends.triton_paged import TritonPagedAttention
    batch = make_batch(QUERY_LENS, SEQ_LENS, 4, HEADS, KV_HEADS, HEAD_SIZE, seed=3)
    torch.testing.assert_close(run_chunked(TritonPagedAttention, batch, 8),
                               dense_reference(batch, 8), atol=1e-5, rtol=1e-5)


def test_a_backend_without_it_refuses():
    with pytest.raises(ValueError, match="flash_attn has no chunked attention"):
        FlashAttentionBackend(HEADS, HEAD_SIZE, 1.0, KV_HEADS, attention_chunk_size=8)
