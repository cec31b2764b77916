"""The attention backends' prefill-only mode (pooling models): bidirectional and causal over each
request's own tokens, no KV cache; and selection passing over backends without it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.attention_backends.base import AttentionMetadata
from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import offer_backend
from runtime.plugins.interfaces import ModelInfo

LENS = [5, 1, 17]


def prefill_only_metadata(lens: list[int], causal: bool) -> AttentionMetadata:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens), block_tables=torch.empty(len(lens), 0, dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_query_len=max(lens),
        max_seq_len=max(lens), prefill_only=True, causal=causal)


@pytest.mark.parametrize("backend", [TorchPagedAttention, CpuPagedAttention])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_only_attention(backend, causal):
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 16
    t = sum(LENS)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    impl = backend(heads, d, d ** -0.5, kv_heads)
    # no cache at all: a prefill-only step must not touch it
    out = impl.forward(q, k, v, torch.empty(0), prefill_only_metadata(LENS, causal))
    lo = 0
    for n in LENS:
        sl = slice(lo, lo + n)
        ref = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1).repeat_interleave(2, 0),
            v[sl].transpose(0, 1).repeat_interleave(2, 0), is_causal=causal).transpose(0, 1)
        torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)
        lo += n


def test_selection_passes_over_backends_without_prefill_only_mode():
    info = ModelInfo(architecture="BertModel", dtype=torch.float32,
                     kv_cache_dtype=torch.float32, head_size=64, num_heads=4, num_kv_heads=4,
                     pooling=True)
    for backend in (TritonPagedAttention, FlashAttentionBackend):
        candidate = offer_backend(backend.name, backend, 10, info, "cuda", "test", [])
        assert candidate.backend is None
        assert "no prefill-only (encoder / pooling) attention" in candidate.reason
    usable = offer_backend("torch_paged", TorchPagedAttention, 0, info, "cpu", "test", [])
    assert usable.backend is TorchPagedAttention, usable.reason
