"""Section 3a of tests/device/run.sh: the Triton paged-attention kernel compiled for the GPU,
against the portable torch backend in float32 on the host, over the shapes the CPU interpreter
is too slow for: bf16 and fp16, block sizes 16 and 256, head sizes 64/128/256 (256 is where the
64-row prefill tile is largest), MQA 32:1, a sliding window over contexts longer than it, and
decodes of few requests over long contexts (the split-KV path, pieces merged by log-sum-exp)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runtime.attention_backends.torch_paged import TorchPagedAttention  # noqa: E402
from runtime.attention_backends.triton_paged import TritonPagedAttention  # noqa: E402
from runtime.testing.paged_batch import make_batch, run_backend  # noqa: E402

# (query_lens, seq_lens), decodes first: decodes at several context lengths, then prefill
# chunks with and without earlier context, crossing 256-token blocks.
MIXED = ([1, 1, 1, 37, 200], [17, 300, 700, 37, 520])
DECODES = ([1] * 6, [1, 16, 17, 255, 257, 900])
DTYPES = [torch.bfloat16, torch.float16]


def check(lens, block_size, heads, kv_heads, head_size, dtype, window=None):
    batch = make_batch(*lens, block_size, heads, kv_heads, head_size, dtype, "cuda")
    reference = make_batch(*lens, block_size, heads, kv_heads, head_size)
    reference = (*(t.to(dtype).float() for t in reference[:4]), reference[4])
    want, want_cache = run_backend(TorchPagedAttention, reference, window)
    got, cache = run_backend(TritonPagedAttention, batch, window)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float().cpu(), want_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_kernel(lens, head_size, block_size, dtype):
    check(lens, block_size, 8, 2, head_size, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mqa_32_to_1(dtype):
    check(MIXED, 16, 32, 1, 128, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
def test_sliding_window(block_size, dtype):
    check(MIXED, block_size, 8, 2, 128, dtype, window=100)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 1000])
def test_split_kv_decodes(dtype, window):
    check(([1, 1], [4100, 20000]), 16, 32, 8, 128, dtype, window)
