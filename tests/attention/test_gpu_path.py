"""The CUDA path's backends on the CPU: FlashAttention through a fake `flash_attn` with the real
library's signatures and checks (the K/V write is the Triton kernel, run by Triton's
interpreter), FlashInfer's decode and prefill plans through a fake `flashinfer`, the TPU
fallback's gather, and the paged-batch harness building its layers where its inputs live."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from runtime.attention_backends import flashinfer
from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention, context_blocks
from runtime.testing.paged_batch import build_layer, make_batch, run_backend, run_two_steps
from tests.platforms.fakes import fake_flash_attn, fake_flashinfer

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not triton.knobs.runtime.interpret,
    reason="checks the CPU path: Triton's interpreter (TRITON_INTERPRET=1), no GPU")

# decodes first, then prefill chunks with and without context, crossing 256-token blocks
MIXED = ([1, 1, 1, 9, 300], [17, 300, 257, 9, 520])
DECODES = ([1, 1, 1], [1, 256, 700])


@needs_interpreter
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("window", [None, 100])
def test_flash_attention_at_block_size_256(monkeypatch, lens, window):
    calls = fake_flash_attn(monkeypatch)
    shape = (*lens, 256, 8, 2, 64)
    got = run_two_steps(FlashAttentionBackend, *shape, torch.float16, "cpu",
                        sliding_window=window)
    want = run_two_steps(TorchPagedAttention, *shape, torch.float32, "cpu",
                         sliding_window=window, input_dtype=torch.float16)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=5e-3, rtol=5e-3)
    # step 1 prefills the context; step 2 is decodes only for DECODES
    assert calls[-1] == ("flash_attn_with_kvcache" if lens is DECODES
                         else "flash_attn_varlen_func")


@needs_interpreter
def test_flash_attention_on_a_graph_padded_decode_batch(monkeypatch):
    """What CUDA-graph capture at --block-size 256 runs: decodes padded to the graph's batch
    size (slot -1, sequence length 0), the host lists frozen at the model's length."""
    fake_flash_attn(monkeypatch)
    query, key, value, kv_cache, md = make_batch([1, 1], [17, 300], 256, 8, 2, 64, torch.float16)
    want, want_cache = run_backend(TorchPagedAttention, (query.float(), key.float(),
                                                         value.float(), kv_cache.float(), md))
    bs, max_len = 4, 2048

    def pad(x: torch.Tensor, value: float = 0) -> torch.Tensor:
        return torch.cat([x, torch.full((bs - x.size(0), *x.shape[1:]), value, dtype=x.dtype)])

    static = dataclasses.replace(
        md, slot_mapping=pad(md.slot_mapping, -1), query_start_loc=torch.arange(bs + 1,
                                                                                dtype=torch.int32),
        seq_lens=pad(md.seq_lens), block_tables=pad(md.block_tables),
        query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[max_len] * bs,
        max_query_len=1, max_seq_len=max_len, num_decode_tokens=bs)
    got, cache = run_backend(FlashAttentionBackend, (pad(query), pad(key), pad(value), kv_cache,
                                                     static))
    torch.testing.assert_close(got[:2].float(), want, atol=5e-3, rtol=5e-3)
    assert got[2:].eq(0).all()
    torch.testing.assert_close(cache.float(), want_cache, atol=0, rtol=0)  # padding wrote nothing


def test_layers_are_built_on_the_batch_device():
    """The layer's FP8 scales live where the layer's inputs do ("meta" stands in for a GPU)."""
    seen = []

    class Probe(TorchPagedAttention):
        def forward(self, query, key, value, kv_cache, metadata):
            seen.append((self.k_scale.device, self.v_scale.device))
            return query

    layer = build_layer(Probe, "meta", 4, 16, 0.25, 2)
    assert layer.k_scale.device.type == layer.v_scale.device.type == "meta"
    batch = make_batch([1, 3], [5, 3], 4, 4, 2, 16, device="meta")
    out, _ = run_backend(Probe, batch)
    assert out.device.type == "meta" and seen == [(out.device, out.device)]
    assert torch.ones(()).device.type == "cpu"  # the default device is left as it was


@pytest.fixture
def flashinfer_plans(monkeypatch):
    monkeypatch.setattr(flashinfer, "_PLANS", {})
    monkeypatch.setattr(flashinfer, "_WORKSPACES", {})
    return fake_flashinfer(monkeypatch)


@pytest.mark.parametrize("lens,kinds", [(([1, 1, 6, 9], [5, 21, 6, 30]), ["prefill", "decode"]),
                                        (([1, 1, 1], [5, 21, 40]), ["decode"]),
                                        (([6, 9], [6, 30]), ["prefill"])])
def test_flashinfer_plans_from_host_lists(flashinfer_plans, lens, kinds):
    """Decodes through the decode wrapper, chunks through the prefill wrapper, each planned
    without reading the metadata's device tensors other than the block table (here on "meta",
    which cannot be read at all)."""
    query, key, value, kv_cache, metadata = make_batch(*lens, 4, 16, 2, 64)
    want = TorchPagedAttention(16, 64, 0.125, 2).forward(query, key, value, kv_cache.clone(),
                                                         metadata)
    blind = dataclasses.replace(metadata, query_start_loc=metadata.query_start_loc.to("meta"),
                                seq_lens=metadata.seq_lens.to("meta"))
    got = FlashInferBackend(16, 64, 0.125, 2).forward(query, key, value, kv_cache.clone(), blind)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [p["kind"] for p in flashinfer_plans] == kinds
    # 8 query heads per KV head: the decode kernel runs on tensor cores
    assert all(p["use_tensor_cores"] for p in flashinfer_plans if p["kind"] == "decode")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_xla_fallback_gathers_only_the_blocks_in_use(dtype, tol):
    """The pure-torch part of the TPU fallback: it reads the block table only as far as the
    longest context's power-of-two bucket of blocks (ids past it are never touched: here they
    are out of range), in the cache's dtype."""
    query, key, value, kv_cache, metadata = make_batch([1, 1, 5], [9, 33, 20], 4, 4, 2, 16, dtype)
    want = TorchPagedAttention(4, 16, 0.25, 2).forward(query.float(), key.float(), value.float(),
                                                       kv_cache.float(), metadata)
    assert context_blocks(metadata.max_seq_len, 4, 64) == 16  # 33 positions: 9 blocks -> 16
    wide = F.pad(metadata.block_tables, (0, 64 - metadata.block_tables.size(1)))
    wide[:, 16:] = 1 << 30
    metadata = dataclasses.replace(metadata, block_tables=wide)
    cache = torch.cat([kv_cache, torch.zeros_like(kv_cache[:, :1])], 1)  # + the scratch block
    got = XlaPagedAttention(4, 16, 0.25, 2).forward(query, key, value, cache, metadata)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
