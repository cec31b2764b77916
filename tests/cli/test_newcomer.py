"""What a new user meets first: `--version`, `python -m runtime`, quiet report commands, one
cache root, the default model by name, and `LLM.chat` reporting its prompt."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import runtime
from runtime.default_model import DEFAULT_MODEL_ID, default_model_path
from runtime.model_loader.source import resolve_model
from runtime.plugins.paths import cache_dir


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_version_and_python_dash_m():
    done = run("-m", "runtime", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == runtime.__version__


def test_plugins_prints_its_table_without_start_up_lines():
    quiet = run("-m", "runtime", "plugins")
    assert quiet.returncode == 0, quiet.stderr
    assert "Plugins:" in quiet.stdout and "INFO" not in quiet.stderr, quiet.stderr
    loud = run("-m", "runtime", "--log-level", "INFO", "plugins")
    assert "INFO runtime.plugins.selection" in loud.stderr


def test_one_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("RUNTIME_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from runtime.model_loader.gguf_cache import cache_root as gguf_root
    from runtime.platforms.cpu.kernels import cache_root as kernels_root
    assert kernels_root() == tmp_path / "xdg" / "runtime" / "cpu_kernels"
    assert gguf_root() == str(tmp_path / "xdg" / "runtime" / "gguf")
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels_root() == tmp_path / "mine" / "cpu_kernels"
    assert gguf_root() == str(tmp_path / "mine" / "gguf")
    assert cache_dir() == tmp_path / "mine"


def test_the_default_model_answers_to_its_hub_id_and_to_default(tmp_path):
    packaged = default_model_path()
    empty_cache = str(tmp_path / "hub")
    for name in (DEFAULT_MODEL_ID, "default"):
        source = resolve_model(name, download_dir=empty_cache)
        assert (source.path, source.format) == (packaged, "gguf")
    # A local Hugging Face cache that has the id wins over the packaged file.
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots"
    (snapshot / "abc123").mkdir(parents=True)
    (snapshot / "abc123" / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs").mkdir()
    (tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" /
     "main").write_text("abc123")
    source = resolve_model(DEFAULT_MODEL_ID, download_dir=empty_cache)
    assert (source.path, source.format) == (str(snapshot / "abc123"), "hf")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        resolve_model("HuggingFaceTB/SomethingElse", download_dir=empty_cache)


def test_chat_outputs_carry_the_rendered_prompt(tiny_llama):
    from runtime import LLM, SamplingParams
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    messages = [{"role": "user", "content": "Hello there"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0))
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
