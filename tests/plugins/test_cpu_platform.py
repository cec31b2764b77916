"""The CPU platform: ISA parsing, dtype and memory choices, and its hooks."""

import pytest
import torch

from runtime.plugins.interfaces import CommunicatorSpec, EagerRunner, ModelInfo, Platform
from runtime.plugins.manager import get_plugin_manager
from runtime.platforms.cpu.compile_runner import CompileRunner
from runtime.platforms.cpu.platform import (GiB, CpuPlatform, kv_cache_budget, normalize_arch,
                                    parse_cpuinfo, parse_meminfo_available)

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma f16c
processor\t: 1
model name\t: ignored
flags\t\t: fpu
"""
SAPPHIRE_RAPIDS = """model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16
"""
COOPER_LAKE = "model name : Xeon\nflags : avx2 avx512f avx512_bf16\n"
GRAVITON3 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"
             "CPU part\t: 0xd40\n")
GRAVITON2 = "Features\t: fp asimd asimddp\nCPU part\t: 0xd0c\n"
MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"

@pytest.fixture(autouse=True)
def cpu_plugin_only(monkeypatch):
    """These tests are about the CPU plugin alone, without the accelerator platforms."""
    monkeypatch.setenv("RUNTIME_PLUGINS", "cpu")


MODEL = ModelInfo(architecture="LlamaForCausalLM", dtype=torch.float32,
                  kv_cache_dtype=torch.float32, head_size=64, num_heads=8, num_kv_heads=2)


class Accelerator(Platform):
    name = "accel"
    device_type = "accel"

    def device(self, local_rank=0):
        return torch.device("meta")

    def default_dtype(self):
        return torch.bfloat16

    def kv_cache_memory_bytes(self, requested, model_bytes):
        return 0


def test_avx2_only_x86_runs_float32():
    info = parse_cpuinfo(EPYC, "x86_64")
    assert info.model_name == "AMD EPYC 7B13"
    assert info.features == {"avx2", "fma"}  # first processor only, known features only
    assert not info.native_bf16
    assert CpuPlatform(info).default_dtype() == torch.float32


@pytest.mark.parametrize("text", [SAPPHIRE_RAPIDS, COOPER_LAKE])
def test_x86_with_bf16_instructions_runs_bfloat16(text):
    assert CpuPlatform(parse_cpuinfo(text, "x86_64")).default_dtype() == torch.bfloat16


def test_arm_features():
    graviton3 = parse_cpuinfo(GRAVITON3, "aarch64")
    assert graviton3.features == {"asimd", "sve", "bf16", "i8mm"}
    assert graviton3.model_name == "0xd40"
    assert CpuPlatform(graviton3).default_dtype() == torch.bfloat16
    assert CpuPlatform(parse_cpuinfo(GRAVITON2, "aarch64")).default_dtype() == torch.float32


def test_missing_cpuinfo_is_safe():
    info = parse_cpuinfo("", "arm64_unknown")
    assert info.features == frozenset() and not info.native_bf16
    assert normalize_arch("AMD64") == "x86_64" and normalize_arch("arm64") == "aarch64"


def test_kv_cache_budget():
    assert parse_meminfo_available(MEMINFO) == 20000000 * 1024
    assert parse_meminfo_available("MemTotal: 1 kB\n") is None
    assert kv_cache_budget(None, 10 * GiB) == 4 * GiB  # 40 % of what is available
    assert kv_cache_budget(None, 100 * GiB) == 8 * GiB  # capped
    assert kv_cache_budget(3 * GiB, 1 * GiB) == 3 * GiB  # the user's number wins
    with pytest.raises(ValueError):
        kv_cache_budget(0, GiB)
    platform = CpuPlatform()
    assert 0 < platform.kv_cache_memory_bytes(None, model_bytes=GiB) <= 8 * GiB
    assert platform.kv_cache_memory_bytes(123, model_bytes=0) == 123


def test_host_platform_basics():
    platform = CpuPlatform()
    assert (platform.name, platform.device_type) == ("cpu", "cpu")
    assert platform.device(3) == torch.device("cpu")
    facts = platform.describe()
    assert facts["arch"] == normalize_arch(__import__("platform").machine())
    assert {"cpu", "cores", "features", "native bf16", "memory available"} <= facts.keys()
    before = torch.get_num_threads()
    try:
        platform.set_num_threads(1)
        assert torch.get_num_threads() == 1
        platform.set_num_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_hooks_ignore_other_platforms():
    hook = get_plugin_manager().hook
    accel = Accelerator()
    assert hook.runtime_attention_backend(platform=accel, model=MODEL, requested=None) is None
    assert hook.runtime_graph_runner(platform=accel, model=MODEL, enforce_eager=False) is None
    assert hook.runtime_communicator(
        platform=accel, spec=CommunicatorSpec([0], 0, "tcp://127.0.0.1:1")) is None
    assert all(c.name == "cpu" and c.priority == 0 for c in hook.runtime_detect_platforms()[0])


def test_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="'flash_attn'.*not offered on platform 'cpu'; known: cpu_paged, torch_paged"):
        get_plugin_manager().hook.runtime_attention_backend(
            platform=CpuPlatform(), model=MODEL, requested="flash_attn")


def test_cpu_attention_backend_can_be_forced_to_the_portable_one():
    from runtime.attention_backends.torch_paged import TorchPagedAttention
    backend = get_plugin_manager().hook.runtime_attention_backend(
        platform=CpuPlatform(), model=MODEL, requested="torch_paged")
    assert backend is TorchPagedAttention


def test_graph_runner_choice(monkeypatch):
    hook = get_plugin_manager().hook
    cpu = CpuPlatform()
    assert isinstance(hook.runtime_graph_runner(platform=cpu, model=MODEL, enforce_eager=False),
                      EagerRunner)
    monkeypatch.setenv("RUNTIME_CPU_COMPILE", "1")
    assert isinstance(hook.runtime_graph_runner(platform=cpu, model=MODEL, enforce_eager=False),
                      CompileRunner)
    assert isinstance(hook.runtime_graph_runner(platform=cpu, model=MODEL, enforce_eager=True),
                      EagerRunner)


def test_compile_runner_handles_changing_shapes():
    runner = CompileRunner(backend="eager")  # dynamo tracing without inductor's C++ build
    runner.capture(lambda x, scale: torch.nn.functional.silu(x) * scale,
                   {"x": torch.randn(4, 8), "scale": 2.0})
    x = torch.randn(7, 8)
    torch.testing.assert_close(runner.run(x=x, scale=2.0), torch.nn.functional.silu(x) * 2.0)
