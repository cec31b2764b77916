"""A model id (org/name) resolves offline from a Hugging Face cache folder built by hand, the
default one or `download_dir`."""
from __future__ import annotations

import shutil

import pytest

from runtime import LLM, SamplingParams
from runtime.model_loader.source import resolve_model

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def _hand_built_cache(root, model_dir: str) -> None:
    repo = root / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def test_model_id_from_download_dir(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hand_built_cache(tmp_path, tiny_llama)
    assert resolve_model("org/tiny", download_dir=str(tmp_path)).path.endswith(COMMIT)
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder"):
        resolve_model("org/absent", download_dir=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = dict(dtype="float32", kv_cache_memory="8MiB")
    by_id = LLM("org/tiny", download_dir=str(tmp_path), **engine).generate([[1, 2, 3]], params)
    by_path = LLM(tiny_llama, **engine).generate([[1, 2, 3]], params)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids
