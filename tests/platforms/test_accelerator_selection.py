"""Platform detection and attention-backend selection for cuda, rocm, xpu and tpu.

Devices and libraries are faked at the detection boundary only (tests/platforms/fakes.py); the
plugins' own detection, priorities, capability checks and messages run for real.
"""
import argparse
import json

import pytest
import torch

from runtime.attention_backends.flash_attention import FlashAttentionBackend
from runtime.attention_backends.flashinfer import FlashInferBackend
from runtime.attention_backends.ipex_paged import IpexPagedAttention
from runtime.attention_backends.pallas_ragged import PallasRaggedAttention
from runtime.attention_backends.torch_paged import TorchPagedAttention
from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention
from runtime.plugins.interfaces import EagerRunner, ModelInfo
from runtime.plugins.backend_choice import AttentionBackendError
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager
from runtime.plugins.selection import (PlatformError, explain_attention_backends,
                               explain_platforms, select_platform)
from runtime.platforms.cuda.graph_runner import CudaGraphRunner
from runtime.platforms.tpu.graph_runner import XlaGraphRunner
from runtime.cli.plugins_cmd import add_plugins_parser, plugins_command
from tests.platforms.fakes import (A100, H100, MAX1550, MI300X, MI355X, T4, fake_gpus,
                                   fake_libraries, fake_torch_xla, fake_xpus)

GPU_LIBS = ("flash_attn", "flashinfer", "triton")


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    for var in ("RUNTIME_PLUGINS", "RUNTIME_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def model(dtype=torch.bfloat16, head_size=128, block_size=16, window=None,
          eager=False, sinks=False) -> ModelInfo:
    return ModelInfo("LlamaForCausalLM", dtype, dtype, head_size, 32, 8, window, block_size,
                     enforce_eager=eager, attention_sinks=sinks)


def choose(platform, requested=None, **kw):
    return get_plugin_manager().hook.runtime_attention_backend(
        platform=platform, model=model(**kw), requested=requested)


def reasons(platform, requested=None, **kw) -> dict[str, str]:
    rows = explain_attention_backends(platform, model(**kw), requested)["backends"]
    return {r["name"]: r["why"] for r in rows}


def test_this_machine_has_no_accelerator():
    rows = {r["name"]: r for r in explain_platforms()}
    assert rows["cpu"]["active"]
    assert "built without CUDA" in rows["cuda"]["why"]
    assert "built without ROCm" in rows["rocm"]["why"]
    assert "torch_xla is not installed" in rows["tpu"]["why"]
    assert not rows["xpu"]["detected"]


def test_cuda_outranks_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, [H100, H100])
    platform = select_platform()
    assert platform.name == "cuda" and platform.device(1) == torch.device("cuda", 1)
    assert platform.default_dtype() == torch.bfloat16
    assert platform.describe()["devices"] == "2 x NVIDIA H100 80GB HBM3"
    assert select_platform("cpu").name == "cpu"


def test_cuda_reasons_when_absent(monkeypatch):
    fake_gpus(monkeypatch, [])
    assert "no CUDA device visible" in {r["name"]: r for r in explain_platforms()}["cuda"]["why"]
    with pytest.raises(PlatformError, match="platform 'cuda' .* is not usable"):
        select_platform("cuda")


def test_hopper_with_every_library(monkeypatch):
    fake_gpus(monkeypatch, [H100])
    fake_libraries(monkeypatch, installed=GPU_LIBS)
    cuda = select_platform()
    assert choose(cuda, block_size=256) is FlashAttentionBackend
    # upstream FlashAttention's paged KV needs blocks of 256; at 16 it says so, and how
    assert ("multiple of 256 (got 16); run with --block-size 256 to use it"
            in reasons(cuda)["flash_attn"])
    # With CUDA graphs on (the default) installing FlashInfer changes nothing: its host-side
    # plan cannot be recorded, so Triton, whose decode steps are recorded, stays first.
    assert choose(cuda) is TritonPagedAttention
    why = reasons(cuda)
    assert why["triton_paged"] == "highest priority (10) among usable backends"
    assert why["flashinfer"].startswith("lower priority (5 < 10): ranked below triton_paged "
                                        "while CUDA graphs are on")
    # eager, FlashInfer leads; forced, it runs with graphs on too
    assert choose(cuda, eager=True) is FlashInferBackend
    assert reasons(cuda, eager=True)["flashinfer"] == (
        "highest priority (20) among usable backends: ranked above triton_paged: execution "
        "is eager, nothing is recorded")
    assert choose(cuda, "flashinfer") is FlashInferBackend
    assert reasons(cuda, "flashinfer")["flashinfer"].startswith(
        "forced (--attention-backend flashinfer): ranked below triton_paged")
    # FlashInfer's head sizes: 96 is not one of them
    assert "head size 96 is not 64, 128 or 256" in reasons(cuda, head_size=96,
                                                             eager=True)["flashinfer"]


def test_attention_sinks_pass_over_flash_attn_and_flashinfer(monkeypatch):
    """gpt-oss's sinks: the FlashAttention 2 and FlashInfer calls take none, Triton applies
    them."""
    fake_gpus(monkeypatch, [H100])
    fake_libraries(monkeypatch, installed=GPU_LIBS)
    cuda = select_platform()
    assert choose(cuda, block_size=256, eager=True, sinks=True) is TritonPagedAttention
    why = reasons(cuda, block_size=256, eager=True, sinks=True)
    for name in ("flash_attn", "flashinfer"):
        assert "no attention sinks (a learned logit per head in the softmax)" in why[name]
    with pytest.raises(ValueError, match="flash_attn has no attention sinks"):
        FlashAttentionBackend(8, 64, 0.125, 2, None, None, torch.zeros(8))


def test_turing_with_triton_only(monkeypatch):
    fake_gpus(monkeypatch, [T4])
    fake_libraries(monkeypatch, installed=("triton",), missing=("flash_attn", "flashinfer"))
    cuda = select_platform()
    assert cuda.default_dtype() == torch.float16 and torch.bfloat16 not in cuda.supported_dtypes()
    assert choose(cuda, dtype=torch.float16) is TritonPagedAttention
    why = reasons(cuda, dtype=torch.float16)
    assert "flash_attn is not installed" in why["flash_attn"]
    assert "needs compute capability 8.0+, this GPU has 7.5" in why["flash_attn"]
    assert "flashinfer is not installed" in why["flashinfer"]
    # bf16 on Turing: Triton refuses, the portable backend is the last resort
    assert choose(cuda, dtype=torch.bfloat16) is TorchPagedAttention
    assert "bfloat16 needs compute capability 8.0+" in reasons(cuda)["triton_paged"]


def test_float32_runs_triton_not_flash(monkeypatch):
    fake_gpus(monkeypatch, [A100])
    fake_libraries(monkeypatch, installed=GPU_LIBS)
    cuda = select_platform()
    assert choose(cuda, dtype=torch.float32, block_size=256) is TritonPagedAttention
    assert "needs float16 or bfloat16" in reasons(cuda, dtype=torch.float32)["flash_attn"]


def test_forcing_a_backend(monkeypatch):
    fake_gpus(monkeypatch, [T4])
    fake_libraries(monkeypatch, installed=("triton",), missing=("flash_attn", "flashinfer"))
    cuda = select_platform()
    assert choose(cuda, "torch_paged", dtype=torch.float16) is TorchPagedAttention
    with pytest.raises(AttentionBackendError) as err:
        choose(cuda, "flash_attn", dtype=torch.float16)
    msg = str(err.value)
    assert msg.startswith("attention backend 'flash_attn' (--attention-backend flash_attn) "
                          "cannot run here.")
    assert "- flash_attn (plugin cuda, priority 30): unusable: flash_attn is not installed" in msg
    assert "- triton_paged (plugin cuda, priority 10): not the forced one" in msg
    with pytest.raises(AttentionBackendError, match="'nosuch' .* is not offered on platform "
                       "'cuda'; known: flash_attn, flashinfer, torch_paged, triton_paged"):
        choose(cuda, "nosuch")


def test_rocm(monkeypatch):
    fake_gpus(monkeypatch, [MI300X], cuda=None, hip="6.2.41133")
    fake_libraries(monkeypatch, installed=("triton",))
    rows = {r["name"]: r for r in explain_platforms()}
    assert "built for ROCm (HIP 6.2.41133), not CUDA" in rows["cuda"]["why"]
    rocm = select_platform()
    assert rocm.name == "rocm" and rocm.device_type == "cuda" and rocm.arch == "gfx942"
    assert rocm.fp8_dtype() == torch.float8_e4m3fnuz
    assert rocm.describe()["fp8 format"] == "float8_e4m3fnuz"
    assert choose(rocm) is TritonPagedAttention
    with pytest.raises(AttentionBackendError, match="'flash_attn' .* not offered on platform "
                       "'rocm'; known: torch_paged, triton_paged"):
        choose(rocm, "flash_attn")
    fake_gpus(monkeypatch, [MI355X], cuda=None, hip="7.0")
    assert select_platform().fp8_dtype() == torch.float8_e4m3fn


def test_xpu(monkeypatch):
    fake_xpus(monkeypatch, [MAX1550])
    fake_libraries(monkeypatch, installed=("intel_extension_for_pytorch", "triton"))
    xpu = select_platform()
    assert xpu.name == "xpu" and xpu.device(0) == torch.device("xpu", 0)
    # Triton and torch's own XPU support first; IPEX (maintained until March 2026) is optional
    assert choose(xpu) is TritonPagedAttention
    assert reasons(xpu)["ipex_paged"].startswith("lower priority (5 < 10): ranked below "
                                                 "triton_paged: IPEX is maintained only until")
    assert choose(xpu, "ipex_paged") is IpexPagedAttention
    assert "sliding-window" in reasons(xpu, window=4096)["ipex_paged"]
    fake_libraries(monkeypatch, installed=("intel_extension_for_pytorch",), missing=("triton",))
    assert choose(xpu) is IpexPagedAttention
    fake_libraries(monkeypatch, missing=("intel_extension_for_pytorch", "triton"))
    assert choose(xpu) is TorchPagedAttention
    assert "intel_extension_for_pytorch is not installed" in reasons(xpu)["ipex_paged"]


def test_tpu(monkeypatch):
    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw):
        raise AssertionError("not called by selection")

    fake_torch_xla(monkeypatch, ragged_kernel=ragged_paged_attention)
    tpu = select_platform()
    assert tpu.name == "tpu" and tpu.describe()["devices"] == "4 TPU cores (PJRT)"
    assert choose(tpu) is PallasRaggedAttention
    assert choose(tpu, head_size=64) is XlaPagedAttention
    assert "not a multiple of 128" in reasons(tpu, head_size=64)["pallas_ragged"]


def test_tpu_reasons(monkeypatch):
    fake_torch_xla(monkeypatch)  # a torch_xla without the ragged kernel
    tpu = select_platform()
    assert choose(tpu) is XlaPagedAttention
    assert "no ragged_paged_attention" in reasons(tpu)["pallas_ragged"]
    fake_torch_xla(monkeypatch, device_type="CPU")
    rows = {r["name"]: r for r in explain_platforms()}
    assert "PJRT drives 'CPU', not TPU" in rows["tpu"]["why"]


def test_graph_runners(monkeypatch):
    hook = get_plugin_manager().hook

    def runner(platform, eager=False):
        return hook.runtime_graph_runner(platform=platform, model=model(), enforce_eager=eager)

    fake_gpus(monkeypatch, [H100])
    cuda = select_platform()
    assert isinstance(runner(cuda), CudaGraphRunner) and runner(cuda).name == "cuda graphs"
    assert isinstance(runner(cuda, eager=True), EagerRunner)
    fake_gpus(monkeypatch, [MI300X], cuda=None, hip="6.2")
    assert runner(select_platform()).name == "hip graphs"
    fake_gpus(monkeypatch, [])
    fake_xpus(monkeypatch, [MAX1550])
    assert isinstance(runner(select_platform()), EagerRunner)
    fake_xpus(monkeypatch, [])
    fake_torch_xla(monkeypatch)
    assert isinstance(runner(select_platform()), XlaGraphRunner)


def test_runtime_plugins_explains_backends(monkeypatch, capsys):
    fake_gpus(monkeypatch, [T4])
    fake_libraries(monkeypatch, installed=("triton",), missing=("flash_attn", "flashinfer"))
    parser = argparse.ArgumentParser()
    add_plugins_parser(parser.add_subparsers())
    assert plugins_command(parser.parse_args(["plugins"])) == 0
    out = capsys.readouterr().out
    assert "Active platform: cuda" in out and "graph runner:       cuda graphs" in out
    assert "Attention backends considered:" in out
    lines = {line.split()[0]: line for line in out.splitlines()[-5:]}
    assert "CHOSEN: highest priority (10)" in lines["triton_paged"]
    assert "unusable: flash_attn is not installed" in lines["flash_attn"]
    assert "lower priority (0 < 10)" in lines["torch_paged"]
    assert plugins_command(parser.parse_args(["plugins", "--json", "--attention-backend",
                                              "flashinfer"])) == 0
    active = json.loads(capsys.readouterr().out)["active"]
    assert active["attention_backend"].startswith("unavailable: AttentionBackendError: "
                                                  "attention backend 'flashinfer'")


def test_runtime_plugins_says_why_flash_attn_and_flashinfer_wait(monkeypatch, capsys):
    fake_gpus(monkeypatch, [H100])
    fake_libraries(monkeypatch, installed=GPU_LIBS)
    parser = argparse.ArgumentParser()
    add_plugins_parser(parser.add_subparsers())
    assert plugins_command(parser.parse_args(["plugins"])) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[-5:]}
    assert "CHOSEN: highest priority (10)" in lines["triton_paged"]
    assert "run with --block-size 256 to use it" in lines["flash_attn"]
    assert "ranked below triton_paged while CUDA graphs are on" in lines["flashinfer"]
