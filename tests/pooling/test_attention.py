"""The attention backends' prefill-only mode (pooling models): bidirectional and causal over each
request's own tokens, no KV cache; and selection passing over backends without it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.platforms.common import offer_backend
from runtime.platforms.cpu import kernels
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.plugins.interfaces import ModelInfo
from runtime.testing.prefill_only_check import check_prefill_only

BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)  # cpu_paged's kernels

@pytest.mark.parametrize("backend", [TorchPagedAttention, CpuPagedAttention])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_only_attention(backend, causal, dtype):
    if backend is CpuPagedAttention and BUILD_ERROR is not None:
        pytest.skip(f"the CPU kernels did not build: {BUILD_ERROR}")
    check_prefill_only(backend, dtype, "cpu", causal)


def test_the_check_catches_causal_attention_in_an_encoder_step():
    class AlwaysCausal(TorchPagedAttention):
        def _encode(self, query, key, value, metadata):
            return super()._encode(query, key, value, dataclasses.replace(metadata, causal=True))

    with pytest.raises(AssertionError, match="bidirectional.*request 0 of 5 tokens"):
        check_prefill_only(AlwaysCausal, torch.float32, "cpu", causal=False)


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


def test_runtime_plugins_explains_pooling_attention(capsys, monkeypatch):
    """`runtime plugins --runner pooling` lists the candidates for a pooling model, and a backend
    without the prefill-only mode with its reason."""
    from runtime.cli.main import main
    monkeypatch.setattr(CpuPagedAttention, "supports_encoder_attention", False)
    assert main(["plugins", "--device", "cpu", "--runner", "pooling", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["active"]["attention_backend"].startswith("torch_paged")
    rows = {row["name"]: row for row in report["active"]["attention_backends"]}
    assert not rows["cpu_paged"]["usable"]
    assert "no prefill-only (encoder / pooling) attention" in rows["cpu_paged"]["reason"]
