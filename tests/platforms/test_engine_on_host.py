"""The accelerator pieces inside the real engine, on the CPU: a host platform plugin that uses
the XLA runner (bucketed shapes, padding, scratch-block writes) with the shape-static backend, or
the Triton backend through Triton's interpreter, must produce the CPU platform's tokens."""
import pytest

from runtime.attention_backends.triton_paged import TritonPagedAttention
from runtime.attention_backends.xla_paged import XlaPagedAttention
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.platforms.tpu.graph_runner import XlaGraphRunner
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import EagerRunner, PlatformCandidate
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager
from runtime import LLM, SamplingParams
from tests.parity import PROMPTS

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
OPTIONS = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48,
               max_num_seqs=4, block_size=8)


class HostPlatform(CpuPlatform):
    """The CPU under another name; like an accelerator, it runs the profiling forward pass."""

    name = "host"
    profiled = 0

    def measure_peak_memory(self, run):
        run()
        HostPlatform.profiled += 1
        return 0


class HostPlugin:
    def __init__(self, backend, runner_cls):
        self.backend, self.runner_cls = backend, runner_cls

    @hookimpl
    def runtime_detect_platforms(self):
        return [PlatformCandidate("host", HostPlatform(), -1)]

    @hookimpl
    def runtime_attention_backend(self, platform):
        return self.backend if platform.name == "host" else None

    @hookimpl
    def runtime_graph_runner(self, platform):
        return self.runner_cls() if platform.name == "host" else None


@pytest.fixture(scope="module")
def cpu_outputs(tiny_llama):
    reset_plugin_manager()
    outs = LLM(tiny_llama, **OPTIONS).generate(PROMPTS[:4], PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _run_host(model, backend, runner_cls):
    reset_plugin_manager()
    get_plugin_manager().register(HostPlugin(backend, runner_cls), name="host")
    try:
        llm = LLM(model, device="host", **OPTIONS)
        return llm, llm.generate(PROMPTS[:4], PARAMS)
    finally:
        reset_plugin_manager()


def _assert_same(outs, expected):
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        for ours, ref in zip(out.outputs[0].logprobs, logprobs):
            t = next(iter(ref))
            assert abs(ours[t].logprob - ref[t].logprob) < 1e-3


def test_xla_runner_and_static_backend(tiny_llama, cpu_outputs):
    llm, outs = _run_host(tiny_llama, XlaPagedAttention, XlaGraphRunner)
    runner = llm.engine.core.executor.worker.runner.graph_runner
    assert isinstance(runner, XlaGraphRunner) and runner.token_buckets[0] == 16
    assert HostPlatform.profiled  # the profiling pass ran on its scratch cache, then was freed
    _assert_same(outs, cpu_outputs)


def test_triton_backend_in_the_engine(tiny_llama, cpu_outputs):
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton is not in interpreter mode")
    _, outs = _run_host(tiny_llama, TritonPagedAttention, EagerRunner)
    _assert_same(outs, cpu_outputs)
