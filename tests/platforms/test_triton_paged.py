"""The Triton paged-attention kernels against the portable torch backend.

Without a GPU the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports Triton); on a GPU (tests/device/run.sh) the same tests
compile them for real. Sizes stay tiny: the interpreter runs each program in numpy.
"""
import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.attention_backends.triton_ops import (INTERPRETER_LIMITS,  # noqa: E402
                                                   decode_splits)
from runtime.attention_backends.triton_paged import TritonPagedAttention  # noqa: E402
from runtime.testing.attention_check import CASES, check_attention  # noqa: E402
from runtime.testing.paged_batch import make_batch, run_backend  # noqa: E402

# (query_lens, seq_lens): decodes first, then prefill chunks with and without earlier context.
MIXED = ([1, 1, 1, 5, 9, 20], [7, 16, 33, 5, 30, 26])
DECODES = ([1, 1, 1, 1], [1, 9, 17, 40])
PREFILLS = ([13, 3], [13, 35])


def _check(query_lens, seq_lens, block_size, heads, kv_heads, head_size=16, window=None,
           dtype=torch.float32, atol=2e-5):
    batch = make_batch(query_lens, seq_lens, block_size, heads, kv_heads, head_size, dtype,
                       DEVICE)
    ref_batch = tuple(t.float().cpu() if isinstance(t, torch.Tensor) else t for t in batch[:4])
    ref_md = make_batch(query_lens, seq_lens, block_size, heads, kv_heads, head_size)[4]
    expected, expected_cache = run_backend(TorchPagedAttention, (*ref_batch, ref_md), window)
    out, cache = run_backend(TritonPagedAttention, batch, window)
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=atol)
    torch.testing.assert_close(cache.float().cpu(), expected_cache, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16, 5])
def test_mixed_batch_gqa(block_size):
    _check(*MIXED, block_size, heads=4, kv_heads=2)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_head_layouts(heads, kv_heads):
    _check(*MIXED, 8, heads, kv_heads)


@pytest.mark.parametrize("lens", [DECODES, PREFILLS], ids=["decode-only", "prefill-only"])
def test_uniform_batches(lens):
    _check(*lens, 8, heads=4, kv_heads=2)


@pytest.mark.parametrize("window", [1, 4, 11])
def test_sliding_window(window):
    _check(*MIXED, 4, heads=4, kv_heads=2, window=window)


def test_head_size_not_a_power_of_two():
    _check(*MIXED, 8, heads=2, kv_heads=1, head_size=24)


@pytest.mark.skipif(DEVICE == "cpu", reason="half precision is checked on a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    _check(*MIXED, 16, heads=8, kv_heads=2, head_size=64, dtype=dtype, atol=2e-2)


@pytest.mark.parametrize("case", ["sinks", "sinks-sliding-window"])
def test_sinks_pass_the_attention_check(case):
    """The conformance suite's sink cases: decodes, prefill chunks and first-step prefills."""
    check_attention(TritonPagedAttention, torch.float32, DEVICE, CASES[case])


@pytest.mark.parametrize("window", [None, 300], ids=["full", "sliding"])
def test_sinks_in_a_split_decode(window):
    """Decodes long enough to be split along the context (flash-decoding), with attention sinks:
    the sink joins the first piece only, so the merge counts it once."""
    query_lens, seq_lens = [1, 1], [700, 530]
    assert decode_splits(2, 2, max(seq_lens), INTERPRETER_LIMITS[1])[0] > 1
    batch = make_batch(query_lens, seq_lens, 16, 4, 2, 16, device=DEVICE)
    ref_batch = tuple(t.float().cpu() if isinstance(t, torch.Tensor) else t for t in batch[:4])
    ref_md = make_batch(query_lens, seq_lens, 16, 4, 2, 16)[4]
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    expected, _ = run_backend(TorchPagedAttention, (*ref_batch, ref_md), window, sinks)
    plain, _ = run_backend(TorchPagedAttention, (*ref_batch, ref_md), window)
    out, _ = run_backend(TritonPagedAttention, batch, window, sinks.to(DEVICE))
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_padding_slots_are_not_written():
    """Graph replay pads the batch with slot -1 and empty requests: nothing is written or read."""
    query, key, value, kv_cache, md = make_batch([1, 1], [3, 6], 4, 2, 1, 16, device=DEVICE)
    md.slot_mapping[1] = -1
    md.seq_lens[1] = 0
    md.seq_lens_cpu[1] = 0
    out, cache = run_backend(TritonPagedAttention, (query, key, value, kv_cache, md))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    changed = (cache != kv_cache).flatten(2).any(-1)  # [2, num_blocks, block_size]
    assert changed.sum() == 2  # only token 0's K and V
