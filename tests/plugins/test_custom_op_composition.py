"""Overriding one named op changes it everywhere: composites are built from the registered ops."""
import pytest
import torch

from runtime.plugins.answers import PlatformAnswers
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.interfaces import PlatformCandidate
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.ops import rms_norm
from runtime.plugins.selection import detect_platforms
from runtime.platforms.cpu import ops as cpu_ops
from runtime.platforms.cpu.platform import CpuPlatform
from runtime.testing.tiny_model import TINY_LLAMA, build_tiny_llama


class CountingNorm:
    """A third party's rms_norm (the portable math), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls += 1
        return rms_norm(x, weight, eps)

    @hookimpl(tryfirst=True)
    def runtime_custom_op(self, name: str):
        return self if name == "rms_norm" else None


@pytest.fixture
def counting_norm():
    norm = CountingNorm()
    get_plugin_manager().register(norm, name="counting_norm")
    return norm


def test_a_plugin_overriding_rms_norm_alone_takes_add_rms_norm_too(counting_norm):
    answers = PlatformAnswers(CpuPlatform())
    assert answers.custom_op("rms_norm") is counting_norm
    # the layer composes it from the registered rms_norm
    assert answers.custom_op("add_rms_norm") is None
    assert {about: r.answered_by for (_, about), r in answers.records.items()} == {
        "rms_norm": "counting_norm", "add_rms_norm": "composed from rms_norm (counting_norm)"}


def test_the_platforms_fused_op_stays_when_nobody_overrides_its_part():
    answers = PlatformAnswers(CpuPlatform())
    fused = answers.custom_op("add_rms_norm")
    assert fused in (cpu_ops.add_rms_norm, None)  # None where the CPU kernels did not build
    assert answers.records["runtime_custom_op", "add_rms_norm"].answered_by == (
        "cpu platform" if fused else None)


def test_every_norm_call_of_a_model_goes_to_the_override(counting_norm, tmp_path):
    from runtime import LLM, SamplingParams
    model = build_tiny_llama(str(tmp_path / "tiny"))
    llm = LLM(model, device="cpu", dtype="float32", enforce_eager=True, kv_cache_memory="16MiB")
    counting_norm.calls = 0
    llm.generate([[1, 5, 9, 23]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    # per forward pass: each layer's input and post-attention norms, then the final norm
    per_forward = 2 * TINY_LLAMA["num_hidden_layers"] + 1
    assert counting_norm.calls == 3 * per_forward


class WrapsSilu:
    """A hook wrapper: pluggy runs it around every implementation of runtime_custom_op."""

    @staticmethod
    def traced(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x[..., :x.size(-1) // 2]) * x[..., x.size(-1) // 2:]

    @hookimpl(wrapper=True)
    def runtime_custom_op(self, name: str):
        op = yield
        return self.traced if name == "silu_and_mul" else op


def test_hook_wrappers_take_part_in_every_answer():
    get_plugin_manager().register(WrapsSilu(), name="wraps_silu")
    answers = PlatformAnswers(CpuPlatform())
    assert answers.custom_op("silu_and_mul") is WrapsSilu.traced
    who = answers.records["runtime_custom_op", "silu_and_mul"].answered_by
    assert who in ("cpu platform, changed by a hook wrapper", "a hook wrapper")
    assert answers.custom_op("rms_norm") in (cpu_ops.rms_norm, None)  # passed through


class AddsAPlatform:
    @hookimpl(wrapper=True)
    def runtime_detect_platforms(self):
        answers = yield
        return [*answers, [PlatformCandidate("wrapped", None, reason="added by a wrapper")]]


def test_a_detection_wrapper_is_honoured():
    get_plugin_manager().register(AddsAPlatform(), name="adds")
    added = [c for c in detect_platforms() if c.name == "wrapped"]
    assert [(c.plugin, c.reason) for c in added] == [("a hook wrapper", "added by a wrapper")]
