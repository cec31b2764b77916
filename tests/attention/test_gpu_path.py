"""The CUDA path's backends on the CPU: FlashAttention through a fake `flash_attn` with the real
library's signatures and checks (the K/V write is the Triton kernel, run by Triton's
interpreter), and the paged-batch harness building its layers where its inputs live."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.testing.paged_batch import build_layer, make_batch, run_backend, run_two_steps
from tests.platforms.fakes import fake_flash_attn

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
