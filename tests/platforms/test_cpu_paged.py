"""The CPU platform's native decode kernel against the portable torch backend."""
import pytest
import torch

from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.interfaces import ModelInfo
from runtime.platforms.cpu import kernels
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.testing.paged_batch import make_batch, run_backend

PLATFORM = CpuPlatform()
BUILD_ERROR = kernels.load(PLATFORM.info.model_name)
pytestmark = pytest.mark.skipif(BUILD_ERROR is not None,
                                reason=f"the CPU kernels did not build: {BUILD_ERROR}")

# decodes of lengths across block edges, a sequence of one token, then prefill chunks
QUERY_LENS = [1, 1, 1, 1, 1, 9, 16]
SEQ_LENS = [1, 16, 17, 40, 93, 20, 16]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("head_size", [64, 128, 40])  # 40 takes the run-time head-size path
def test_matches_the_portable_backend(dtype, tol, heads, window, head_size):
    num_heads, num_kv_heads = heads
    batch = make_batch(QUERY_LENS, SEQ_LENS, 16, num_heads, num_kv_heads, head_size, dtype,
                       seed=3)
    got, got_cache = run_backend(CpuPagedAttention, batch, window)
    want, want_cache = run_backend(TorchPagedAttention, batch, window)
    torch.testing.assert_close(got_cache, want_cache, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,head_size", [((9, 3), 64), ((16, 4), 64), ((9, 3), 128),
                                             ((12, 3), 128), ((3, 1), 32)])
@pytest.mark.parametrize("window", [None, 40])
def test_ragged_decodes_split_over_threads(threads, dtype, tol, heads, head_size, window):
    """Decodes alone, of 1 token to 13 blocks, over 2 and 3 threads: the runs of items the
    threads take, cut by blocks read, cover every item once. Over 2 threads the 9 sequences are
    enough for an item to take all of a sequence's KV heads, over 3 an item is one (sequence,
    KV head) pair. GQA groups of 3 and 4 take the V pass's register tiles of each size (4 heads
    of 64 at once, 2 and then 1 or 2 of 128), and head size 32 the run-time path."""
    lens = [1, 200, 17, 16, 97, 3, 150, 64, 33]
    batch = make_batch([1] * len(lens), lens, 16, *heads, head_size, dtype, seed=7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, _ = run_backend(CpuPagedAttention, batch, window)
    finally:
        torch.set_num_threads(before)
    want, _ = run_backend(TorchPagedAttention, batch, window)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 7, 33, 1, 5], [30, 64, 7, 100, 49, 5]),  # decodes, chunks past a prefix, fresh ones
    ([3, 16, 40], [3, 16, 40]),  # every chunk starts its request: encoder_attention
])
def test_prefill_chunks_match_the_portable_backend(dtype, tol, heads, head_size, query_lens,
                                                   seq_lens):
    """Prefill chunks over cached contexts (prefill_attention: chunks of 1 and of several
    blocks, contexts ending mid-block) and fresh prompts (encoder_attention)."""
    batch = make_batch(query_lens, seq_lens, 16, *heads, head_size, dtype, seed=5)
    got, _ = run_backend(CpuPagedAttention, batch, None)
    want, _ = run_backend(TorchPagedAttention, batch, None)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_prefill_chunks_take_the_paged_kernel():
    """A step with a chunk past its cached prefix reads the context in the cache natively:
    no SDPA call, no gathered copy of the context."""
    batch = make_batch([1, 9, 16], [20, 40, 16], 16, 4, 2, 64, torch.float32, seed=1)
    with torch.profiler.profile() as prof:
        run_backend(CpuPagedAttention, batch, None)
    names = {e.key for e in prof.key_averages()}
    assert "runtime_cpu::prefill_attention" in names
    assert not any("scaled_dot_product" in n for n in names)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("head_size", [128, 40])
def test_sinks_match_the_portable_backend(dtype, tol, window, head_size):
    """Attention sinks in the head-size paths of the decode kernel the conformance suite (head
    size 64) does not reach, GQA 4 over 2."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, 16, 4, 2, head_size, dtype, seed=3)
    sinks = torch.tensor([-2.0, 0.5, 1.5, 3.0])
    got, _ = run_backend(CpuPagedAttention, batch, window, sinks)
    want, _ = run_backend(TorchPagedAttention, batch, window, sinks)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    plain, _ = run_backend(TorchPagedAttention, batch, window)
    assert not torch.allclose(want.float(), plain.float(), atol=10 * tol)


def test_sinks_must_be_float32_per_query_head():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 16, 2, 16)
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32"):
        torch.ops.runtime_cpu.paged_attention_decode(
            q.clone(), q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0, -1, 1.0, 1.0, torch.zeros(3))


def test_head_size_must_be_a_multiple_of_eight():
    ok, why = CpuPagedAttention.supports(20, torch.float32, torch.float32, None, "cpu")
    assert not ok and "multiple of 8" in why
    q = torch.zeros(1, 2, 20)
    cache = torch.zeros(2, 16, 2, 20)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.runtime_cpu.paged_attention_decode(
            q.clone(), q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0, -1)


def model(head_size: int, dtype: torch.dtype = torch.float32) -> ModelInfo:
    return ModelInfo(architecture="LlamaForCausalLM", dtype=dtype, kv_cache_dtype=dtype,
                     head_size=head_size, num_heads=4, num_kv_heads=2, sliding_window=None,
                     block_size=16)


def test_platform_prefers_the_native_kernel_and_falls_back():
    hook = get_plugin_manager().hook
    choose = lambda m, r=None: hook.runtime_attention_backend(platform=PLATFORM, model=m,
                                                              requested=r)
    assert choose(model(64)) is CpuPagedAttention
    assert choose(model(64), "torch_paged") is TorchPagedAttention
    assert choose(model(20)) is TorchPagedAttention  # not a multiple of 8
    with pytest.raises(ValueError, match="cpu_paged.*multiple of 8"):
        choose(model(20), "cpu_paged")
