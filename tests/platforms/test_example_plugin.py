"""examples/plugin built as a real wheel, installed, discovered through its entry point and used.

The engine must pick up its fused RMSNorm on the CPU platform (tryfirst) and its Granite
architecture, and produce the same tokens as without it (Granite: as transformers does).
"""
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from runtime.plugins.manager import discovered_plugins, get_plugin_manager, reset_plugin_manager
from runtime.platforms.cpu.platform import CpuPlatform
from runtime import LLM, SamplingParams
from runtime.layers.layernorm import RMSNorm
from runtime.models.registry import choose_model
from runtime.plugins.ops import rms_norm
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

EXAMPLE = Path(__file__).parents[2] / "examples" / "plugin"
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
OPTIONS = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64)
GRANITE = dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.4,
               logits_scaling=2.0)


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet"], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.fail(f"pip {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """Build the example's wheel and install it into a private folder."""
    root = tmp_path_factory.mktemp("example_plugin")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                "*.egg-info"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(root / "dist"), str(src))
    (wheel,) = (root / "dist").glob("runtime_example_plugin-*.whl")
    _pip("install", "--no-deps", "--no-index", "--target", str(root / "site"), str(wheel))
    return root / "site"


@pytest.fixture
def example_plugin(example_site, monkeypatch):
    monkeypatch.delenv("RUNTIME_PLUGINS", raising=False)
    sys.path.insert(0, str(example_site))
    importlib.invalidate_caches()
    reset_plugin_manager()
    yield
    sys.path.remove(str(example_site))
    for name in [m for m in sys.modules if m.split(".")[0] == "runtime_example_plugin"]:
        del sys.modules[name]
    importlib.invalidate_caches()
    reset_plugin_manager()


def _generate(model: str) -> tuple[LLM, list]:
    llm = LLM(model, **OPTIONS)
    return llm, llm.generate(PROMPTS, PARAMS)


def test_discovered_and_answers_for_the_cpu_only(example_plugin):
    record = {r.name: r for r in discovered_plugins()}["example"]
    assert (record.source, record.loaded, record.target) == (
        "runtime-example-plugin", True, "runtime_example_plugin")
    hook = get_plugin_manager().hook
    from runtime_example_plugin import fused_rms_norm
    assert hook.runtime_custom_op(platform=CpuPlatform(), name="rms_norm") is fused_rms_norm
    # Ops the example does not replace stay with the CPU platform (its kernels, or portable).
    from runtime.platforms.cpu import ops
    assert hook.runtime_custom_op(platform=CpuPlatform(), name="silu_and_mul") in (
        ops.silu_and_mul, None)
    x, w = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(fused_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    x16 = x.bfloat16()
    torch.testing.assert_close(fused_rms_norm(x16, w.bfloat16(), 1e-6),
                               rms_norm(x16, w.bfloat16(), 1e-6))


def test_same_tokens_with_and_without_it(tiny_llama, example_site, monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", "cpu")
    reset_plugin_manager()
    _, without = _generate(tiny_llama)
    monkeypatch.delenv("RUNTIME_PLUGINS")
    sys.path.insert(0, str(example_site))
    importlib.invalidate_caches()
    reset_plugin_manager()
    try:
        llm, with_plugin = _generate(tiny_llama)
        norms = [m for m in llm.engine.core.executor.worker.runner.model.modules()
                 if isinstance(m, RMSNorm)]
        assert norms and all(m.op.__module__ == "runtime_example_plugin" for m in norms)
    finally:
        sys.path.remove(str(example_site))
        reset_plugin_manager()
    assert [o.outputs[0].token_ids for o in with_plugin] == \
           [o.outputs[0].token_ids for o in without]


def test_granite_matches_transformers(tiny_model_factory, example_plugin):
    """A plugin's architecture takes the place of the built-in class of the same name."""
    path = tiny_model_factory("GraniteForCausalLM", **GRANITE)
    hf = transformers.GraniteForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, PARAMS.max_tokens) for p in PROMPTS]
    llm, outs = _generate(path)
    model = llm.engine.core.executor.worker.runner.model
    assert type(model).__module__ == "runtime_example_plugin.granite"
    assert_matches_hf(outs, references)


def test_granite_runs_under_pipeline_parallel(tiny_model_factory, example_plugin):
    """The plugin's model has no pipeline code: the runner moves its stages' hidden states."""
    path = tiny_model_factory("GraniteForCausalLM", **GRANITE)
    hf = transformers.GraniteForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, PARAMS.max_tokens) for p in PROMPTS]
    llm = LLM(path, pipeline_parallel_size=2, num_threads=1, **OPTIONS)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.core.shutdown()
    assert_matches_hf(outs, references)


def test_granite_without_the_plugin_is_the_built_in_class(monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", "cpu")
    reset_plugin_manager()
    try:
        choice = choose_model(["GraniteForCausalLM"], "native")
    finally:
        reset_plugin_manager()
    assert choice.model_class.__module__ == "runtime.models.granite"
