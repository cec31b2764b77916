"""The CPU platform: ISA parsing, dtype and memory choices, and its hooks."""

import pytest
import torch

from runtime.plugins.interfaces import CommunicatorSpec, EagerRunner, ModelInfo, Platform
from runtime.plugins.manager import get_plugin_manager
from runtime.platforms.cpu.platform import CpuPlatform

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


class HostDevice(Platform):
    """A third party's platform that computes on the host: device_type "cpu", not a CpuPlatform."""

    name = "hostdev"
    device_type = "cpu"

    def device(self, local_rank=0):
        return torch.device("cpu")

    def default_dtype(self):
        return torch.float32

    def kv_cache_memory_bytes(self, requested, model_bytes):
        return 1 << 20


class HostDeviceWithCpuKernels(CpuPlatform):
    name = "hostdev-cpu"


def test_a_host_platform_gets_nothing_from_the_cpu_plugin_unless_it_subclasses_it():
    from runtime.attention_backends.torch_paged import TorchPagedAttention
    from runtime.platforms.cpu import ops
    hook = get_plugin_manager().hook
    spec = CommunicatorSpec([0], 0, "tcp://127.0.0.1:1")
    plain = HostDevice()
    assert hook.runtime_attention_backend(platform=plain, model=MODEL,
                                          requested=None) is TorchPagedAttention
    assert [c.name for c in hook.runtime_attention_backend_candidates(
        platform=plain, model=MODEL)[0]] == ["torch_paged"]
    assert type(hook.runtime_graph_runner(platform=plain, model=MODEL,
                                          enforce_eager=False)) is EagerRunner
    assert hook.runtime_communicator(platform=plain, spec=spec) is None
    for name in ("linear", *ops.OPS):
        assert hook.runtime_custom_op(platform=plain, name=name) is None, name
    assert hook.runtime_quantization_kernel(platform=plain, method="int8",
                                            params={"bits": 8}) is None
    assert plain.ray_resource() == "GPU"

    sub = HostDeviceWithCpuKernels()
    assert hook.runtime_custom_op(platform=sub, name="linear") is ops.linear
    names = [c.name for c in hook.runtime_attention_backend_candidates(platform=sub,
                                                                       model=MODEL)[0]]
    assert names == ["cpu_paged", "torch_paged"]
    assert sub.ray_resource() == "CPU"


def test_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="'flash_attn'.*not offered on platform 'cpu'; known: cpu_paged, torch_paged"):
        get_plugin_manager().hook.runtime_attention_backend(
            platform=CpuPlatform(), model=MODEL, requested="flash_attn")


def test_cpu_attention_backend_can_be_forced_to_the_portable_one():
    from runtime.attention_backends.torch_paged import TorchPagedAttention
    backend = get_plugin_manager().hook.runtime_attention_backend(
        platform=CpuPlatform(), model=MODEL, requested="torch_paged")
    assert backend is TorchPagedAttention


def test_graph_runner_choice():
    hook = get_plugin_manager().hook
    cpu = CpuPlatform()
    for eager in (False, True):
        assert isinstance(hook.runtime_graph_runner(platform=cpu, model=MODEL,
                                                    enforce_eager=eager), EagerRunner)
