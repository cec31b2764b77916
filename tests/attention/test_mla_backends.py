"""The MLA backends against float32 multi-head latent attention math (the conformance suite's
MLA check), the Triton decode kernel through Triton's interpreter, and the check failing
planted bugs of an absorbed decode."""
from __future__ import annotations

import pytest
import torch

from runtime.attention_backends.mla import TorchMLAAttention, latent_attention
from runtime.attention_backends.mla_cpu import CpuMLAAttention
from runtime.plugins.interfaces import ModelInfo
from runtime.testing.mla_check import check_mla_attention

MLA_MODEL = ModelInfo("DeepseekV3ForCausalLM", torch.bfloat16, torch.bfloat16, head_size=576,
                      num_heads=16, num_kv_heads=1, attention_kind="mla")


@pytest.fixture(scope="module")
def cpu_kernels():
    from runtime.platforms.cpu.platform import CpuPlatform
    failed = CpuPlatform().kernel_build_error()
    if failed:
        pytest.skip(f"the CPU kernels did not build: {failed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_portable_and_cpu_backends(dtype, cpu_kernels):
    check_mla_attention(TorchMLAAttention, dtype, "cpu")
    check_mla_attention(CpuMLAAttention, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_decode_kernel(dtype):
    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set")
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bfloat16 is checked on a GPU: Triton's interpreter computes bf16 dots in "
                    "numpy, wrongly")
    from runtime.attention_backends.mla_triton import TritonMLAAttention
    check_mla_attention(TritonMLAAttention, dtype,
                        "cuda" if torch.cuda.is_available() else "cpu")


class DefaultScale(TorchMLAAttention):
    """Decodes at 1/sqrt(qk head dim) instead of the layer's scale (YaRN's mscale dropped)."""

    def decode_latent(self, q, kv_cache, block_tables, seq_lens, seq_lens_cpu):
        self.scale, kept = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5, self.scale
        try:
            return super().decode_latent(q, kv_cache, block_tables, seq_lens, seq_lens_cpu)
        finally:
            self.scale = kept


class NoRopeScores(TorchMLAAttention):
    """Decode scores over the latent part only, dropping the shared rope key."""

    def decode_latent(self, q, kv_cache, block_tables, seq_lens, seq_lens_cpu):
        q = torch.cat((q[..., :self.kv_lora_rank], torch.zeros_like(q[..., self.kv_lora_rank:])),
                      -1)
        return super().decode_latent(q, kv_cache, block_tables, seq_lens, seq_lens_cpu)


class UnorderedBlocks(TorchMLAAttention):
    """Decodes read the cache as if each sequence's blocks were in id order."""

    def decode_latent(self, q, kv_cache, block_tables, seq_lens, seq_lens_cpu):
        return super().decode_latent(q, kv_cache, block_tables.sort(1).values, seq_lens,
                                     seq_lens_cpu)


@pytest.mark.parametrize("bug", [DefaultScale, NoRopeScores, UnorderedBlocks],
                         ids=lambda b: b.__name__)
def test_check_fails_planted_decode_bugs(bug):
    with pytest.raises(AssertionError, match="step 2.*\\n.*✗ decode rows"):
        check_mla_attention(bug, torch.float32, "cpu")


def test_latent_attention_is_attention_over_one_shared_head():
    """The reference latent attention: softmax(scale q.k) over the whole latent, values its
    first kv_lora_rank dims, masked keys ignored."""
    gen = torch.Generator().manual_seed(0)
    q, latents = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 5, 12, generator=gen)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    got = latent_attention(q, latents, mask, 8, 0.5)
    for b, n in enumerate((5, 2)):
        probs = (q[b] @ latents[b, :n].T * 0.5).softmax(-1)
        torch.testing.assert_close(got[b], probs @ latents[b, :n, :8])


def test_accelerators_offer_their_mla_backends_for_mla_models():
    """CUDA, ROCm and XPU list triton_mla then torch_mla for an MLA model (no K/V backend);
    an FP8 cache or a GPU below Triton's compute capability refuses triton_mla, saying why."""
    from dataclasses import replace

    from runtime.platforms.cuda.attention import attention_candidates as cuda
    from runtime.platforms.rocm.attention import attention_candidates as rocm
    from runtime.platforms.xpu.attention import attention_candidates as xpu
    for candidates in (cuda((9, 0), MLA_MODEL), rocm(MLA_MODEL), xpu(MLA_MODEL)):
        assert [(c.name, c.backend is not None and c.backend.kind) for c in candidates] == \
            [("triton_mla", "mla"), ("torch_mla", "mla")]
    old = cuda((7, 0), MLA_MODEL)[0]
    assert old.backend is None and "compute capability 7.5+" in old.reason
    fp8 = cuda((9, 0), replace(MLA_MODEL, kv_cache_dtype=torch.float8_e4m3fn))
    assert all(c.backend is None and "FP8" in c.reason for c in fp8)
