"""The FP8 KV cache in each backend: the round trip through the cache, saturation, each backend
against itself in full precision and against the portable one, and backend selection.

e4m3 keeps 3 mantissa bits (a stored value is within 2^-4 of x / scale, relatively, for normal
numbers), e5m2 keeps 2 (2^-3). The Triton kernels run through Triton's interpreter on the CPU,
compiled on a GPU when there is one (then half precision is checked too).
"""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from runtime.attention_backends.base import FP8_KV_CACHE_DTYPES, kv_cache_torch_dtype
from runtime.attention_backends.cpu_paged import CpuPagedAttention
from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.ipex_paged import IpexPagedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention, quantize_kv
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.cli.plugins_cmd import add_plugins_parser, plugins_command
from runtime.plugins.interfaces import ModelInfo
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.selection import explain_attention_backends, select_platform
from runtime.platforms.cpu import kernels
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.testing.paged_batch import in_layout, make_batch, token_major
from tests.platforms.fakes import H100, MAX1550, fake_gpus, fake_libraries, fake_xpus
from tests.platforms.test_accelerator_selection import fresh_plugins  # noqa: F401 (a fixture)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
K_SCALE, V_SCALE = 0.02, 0.05
# decodes across block edges, a one-token sequence, prefill chunks with and without context
QUERY_LENS = [1, 1, 1, 1, 5, 9, 16]
SEQ_LENS = [1, 16, 17, 40, 5, 20, 30]
CPU_BUILD_ERROR = kernels.load(CpuPlatform().info.model_name)
needs_cpu_kernels = pytest.mark.skipif(CPU_BUILD_ERROR is not None,
                                       reason=f"the CPU kernels did not build: {CPU_BUILD_ERROR}")
triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not triton.knobs.runtime.interpret,
                                  reason="no GPU, and Triton was imported before "
                                         "TRITON_INTERPRET=1 was set")


def fp8_bytes(dtype: torch.dtype, shape: torch.Size, seed: int = 0) -> torch.Tensor:
    """A cache of random FP8 codes: every value of magnitude up to 240 (subnormals included),
    so that with the test's scales the scores stay in a range softmax tells apart."""
    codes = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.uint8)
    values = codes.view(dtype).float()
    codes[~(values.abs() <= 240)] = 0
    return codes.view(dtype)


def backend(cls, num_heads: int, head_size: int, num_kv_heads: int, window=None,
            scales=(K_SCALE, V_SCALE), device="cpu"):
    with torch.device(device):  # where the scales live
        impl = cls(num_heads, head_size, head_size ** -0.5, num_kv_heads, window)
    impl.set_kv_scales(*scales)
    return impl


def on(device: str, batch):
    """A copy of make_batch's (query, key, value, cache, metadata) on `device`."""
    *tensors, md = batch
    moved = {name: getattr(md, name).to(device) for name in
             ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")}
    return (*(t.to(device) for t in tensors), dataclasses.replace(md, **moved))


def fp8_batch(dtype, fp8, head_size=64, heads=(8, 2), block_size=16, seed=0):
    """make_batch's random batch, its cache holding random FP8 codes."""
    q, k, v, cache, md = make_batch(QUERY_LENS, SEQ_LENS, block_size, *heads, head_size, dtype,
                                    seed=seed)
    return q, k * 3, v * 3, fp8_bytes(fp8, cache.shape, seed), md


@pytest.mark.parametrize("fp8", FP8)
def test_round_trip_saturation_and_rounding(fp8):
    impl = backend(TorchPagedAttention, 2, 8, 1)
    top = torch.finfo(fp8).max
    key = torch.tensor([[[1.0, -1.0, 0.3, 1e-7, 0.0, 1e9, -1e9, top * K_SCALE * 1.01]]])
    cache = torch.zeros(2, 1, 4, 1, 8, dtype=fp8)
    md = make_batch([1], [1], 4, 2, 1, 8)[4]
    md.slot_mapping.zero_()
    md.block_tables.zero_()
    impl.forward(torch.zeros(1, 2, 8), key, key * 2, cache, md)
    stored = cache[0, 0, 0, 0].float()
    assert torch.equal(stored, (key[0, 0] / K_SCALE).clamp(-top, top).to(fp8).float())
    assert stored[5:].abs().eq(top).all() and stored.isfinite().all()  # saturated, never inf
    back = stored * K_SCALE
    normal = key[0, 0].abs() / K_SCALE >= 2.0 ** (-6 if fp8 == E4M3 else -14)
    normal &= key[0, 0].abs() <= top * K_SCALE
    rel = ((back - key[0, 0]).abs() / key[0, 0].abs())[normal]
    assert rel.max() <= 2.0 ** -(MANTISSA_BITS[fp8] + 1)
    # V has its own scale
    assert torch.equal(cache[1, 0, 0, 0].float(),
                       (2 * key[0, 0] / V_SCALE).clamp(-top, top).to(fp8).float())


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("cls", [TorchPagedAttention, CpuPagedAttention])
def test_fp8_cache_against_the_same_backend_in_float32(cls, fp8):
    """Exact against the float32 cache holding the same rounded values (whose backend has the
    same scales set, and must ignore them); and within the format's rounding (measured, below)
    of attention over unrounded K/V."""
    if cls is CpuPagedAttention and CPU_BUILD_ERROR is not None:
        pytest.skip(f"the CPU kernels did not build: {CPU_BUILD_ERROR}")
    q, k, v, _, md = make_batch(QUERY_LENS, SEQ_LENS, 16, 8, 2, 64, seed=1)
    scales = torch.tensor([K_SCALE, V_SCALE]).view(2, 1, 1, 1, 1)
    full = torch.randn(2, *make_batch(QUERY_LENS, SEQ_LENS, 16, 8, 2, 64)[3].shape[1:],
                       generator=torch.Generator().manual_seed(2))
    cache8 = (full / scales).to(fp8)
    got = backend(cls, 8, 64, 2).forward(q, k, v, in_layout(cls, cache8), md)
    rounded = cache8.float() * scales
    round_trip = (lambda x, s: quantize_kv(x, torch.tensor(s), fp8).float() * s)
    want = backend(cls, 8, 64, 2).forward(q, round_trip(k, K_SCALE), round_trip(v, V_SCALE),
                                          in_layout(cls, rounded), md)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    unrounded = backend(cls, 8, 64, 2).forward(q, k, v, in_layout(cls, full), md)
    # relative error measured 0.032 (e4m3; its RMS rounding error is 2^-4 / sqrt(3) = 0.036)
    # and 0.062 (e5m2), for both backends
    error = (got - unrounded).norm() / unrounded.norm()
    assert error < {E4M3: 0.05, E5M2: 0.1}[fp8]


@needs_cpu_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_size,heads,window", [(64, (8, 2), None), (128, (4, 4), 8),
                                                     (40, (6, 1), None)])
def test_cpu_kernel_matches_the_portable_backend(fp8, dtype, tol, head_size, heads, window):
    """Every FP8 code (subnormals too) decoded in registers as torch decodes it; 40 takes the
    run-time head-size path."""
    q, k, v, cache, md = fp8_batch(dtype, fp8, head_size, heads)
    got_cache, want_cache = in_layout(CpuPagedAttention, cache), cache.clone()
    got = backend(CpuPagedAttention, heads[0], head_size, heads[1], window).forward(
        q, k, v, got_cache, md)
    want = backend(TorchPagedAttention, heads[0], head_size, heads[1], window).forward(
        q, k, v, want_cache, md)
    assert torch.equal(token_major(CpuPagedAttention, got_cache).view(torch.uint8),
                       want_cache.view(torch.uint8))
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def check_triton(fp8, block_size, heads, window, dtype=torch.float32, tol=2e-5):
    """Same bytes written (rounding and saturation done in integer code), same attention as
    the portable backend on the CPU in float32."""
    batch = fp8_batch(dtype, fp8, 16 if DEVICE == "cpu" else 64, heads, block_size)
    q, k, v, cache, md = on(DEVICE, batch)
    head_size = q.size(-1)
    got = backend(TritonPagedAttention, heads[0], head_size, heads[1], window,
                  device=DEVICE).forward(q, k, v, cache, md)
    q, k, v, want_cache, md = on("cpu", (q.float(), k.float(), v.float(), *batch[3:]))
    want = backend(TorchPagedAttention, heads[0], head_size, heads[1], window).forward(
        q, k, v, want_cache, md)
    assert torch.equal(cache.cpu().view(torch.uint8), want_cache.view(torch.uint8))
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("block_size,heads,window", [(16, (8, 2), None), (5, (4, 1), 7)])
def test_triton_matches_the_portable_backend(fp8, block_size, heads, window):
    check_triton(fp8, block_size, heads, window)


@pytest.mark.skipif(DEVICE == "cpu", reason="half precision is checked on a GPU")
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(fp8, dtype):
    check_triton(fp8, 16, (8, 2), None, dtype, tol=3e-2)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_triton_encodes_every_magnitude_as_torch_does(fp8):
    from runtime.attention_backends.triton_ops import write_kv
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 448, 464, 480, 57344, 61440, 1e30, -1e30, 2.0 ** -10])
    x = torch.cat([special] + [torch.randn(512, generator=gen) * 10.0 ** e for e in range(-9, 7)])
    x = x[:x.numel() // 128 * 128].view(-1, 1, 128)  # few rows: the interpreter runs each alone
    cache = torch.zeros(2, x.size(0), 1, 1, 128, dtype=fp8, device=DEVICE)
    one = torch.ones((), device=DEVICE)
    write_kv(x.to(DEVICE), -x.to(DEVICE), cache[0], cache[1],
             torch.arange(x.size(0), device=DEVICE), one, one)
    for half, values in zip(cache.cpu(), (x, -x)):
        assert torch.equal(half.flatten().view(torch.uint8),
                           quantize_kv(values, torch.ones(()), fp8).flatten().view(torch.uint8))


def test_calculated_scales_map_the_batch_maximum():
    impl = backend(TorchPagedAttention, 2, 8, 1, scales=(None, None))
    key, value = torch.tensor([[1.0, -400.0]]), torch.zeros(1, 2)
    impl.calculate_kv_scales(key, value)
    assert impl.k_scale.item() == pytest.approx(400 / 200) and impl.v_scale.item() == 1.0


def test_scales_must_be_positive_and_names_must_be_known():
    with pytest.raises(ValueError, match="positive finite"):
        backend(TorchPagedAttention, 2, 8, 1, scales=(0.0, 1.0))
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is E4M3
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError,
                       match="must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


# --- backend selection ------------------------------------------------------------------------

def fp8_model(block_size=16, eager=False) -> ModelInfo:
    return ModelInfo("LlamaForCausalLM", torch.bfloat16, E4M3, 128, 32, 8, None, block_size,
                     enforce_eager=eager)


def test_backends_declare_whether_they_keep_fp8():
    for cls in (TorchPagedAttention, CpuPagedAttention, TritonPagedAttention):
        assert cls.supports_kv_cache_dtype(torch.bfloat16, E5M2) == (True, "")
    for cls in (FlashAttentionBackend, FlashInferBackend, IpexPagedAttention):
        ok, why = cls.supports_kv_cache_dtype(torch.bfloat16, E4M3)
        assert not ok and "no FP8" in why


def test_cpu_picks_its_native_kernel_for_fp8():
    cpu = select_platform("cpu")
    choice = get_plugin_manager().hook.runtime_attention_backend(
        platform=cpu, model=fp8_model(), requested=None)
    assert choice is (CpuPagedAttention if CPU_BUILD_ERROR is None else TorchPagedAttention)


def test_gpus_pass_over_backends_without_fp8(monkeypatch, capsys):
    fake_gpus(monkeypatch, [H100])
    fake_libraries(monkeypatch, installed=("flash_attn", "flashinfer", "triton"))
    cuda = select_platform()
    # eager at block size 256, flash_attn then flashinfer would lead; neither keeps FP8
    explained = explain_attention_backends(cuda, fp8_model(256, eager=True), None)
    why = {row["name"]: row["why"] for row in explained["backends"]}
    assert explained["chosen"] == "triton_paged"
    assert "no FP8 (float8_e4m3fn)" in why["flash_attn"]
    assert "no FP8 (float8_e4m3fn)" in why["flashinfer"]
    parser = argparse.ArgumentParser()
    add_plugins_parser(parser.add_subparsers())
    assert plugins_command(parser.parse_args(["plugins", "--kv-cache-dtype", "fp8"])) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[-5:]}
    assert "CHOSEN" in lines["triton_paged"]
    assert "no FP8" in lines["flash_attn"] and "no FP8" in lines["flashinfer"]
    fake_xpus(monkeypatch, [MAX1550])
    fake_libraries(monkeypatch, installed=("intel_extension_for_pytorch",), missing=("triton",))
    xpu = select_platform("xpu")
    why = {row["name"]: row["why"] for row in
           explain_attention_backends(xpu, fp8_model(), None)["backends"]}
    assert "no FP8" in why["ipex_paged"]
    assert get_plugin_manager().hook.runtime_attention_backend(
        platform=xpu, model=fp8_model(), requested=None) is TorchPagedAttention


def test_every_fp8_name_maps_to_a_torch_dtype():
    assert set(FP8_KV_CACHE_DTYPES.values()) == set(FP8)
