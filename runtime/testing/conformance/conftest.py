"""Fixtures of the conformance suite: the platform under test, its hooks, a tiny model."""
from __future__ import annotations

import os

import pytest
import torch

from runtime.plugins.interfaces import ModelInfo, Platform
from runtime.plugins.manager import get_plugin_manager
from runtime.plugins.selection import select_platform
from runtime.testing.tiny_model import build_tiny_llama

DEVICE_ENV = "RUNTIME_DEVICE"


@pytest.fixture(scope="session")
def device_name(request: pytest.FixtureRequest) -> str | None:
    """`--device` (from the suite's plugin, when loaded), else RUNTIME_DEVICE, else None."""
    return request.config.getoption("--device", None) or os.environ.get(DEVICE_ENV) or None


@pytest.fixture(scope="session")
def platform(device_name: str | None) -> Platform:
    return select_platform(device_name)


@pytest.fixture(scope="session")
def hook():
    return get_plugin_manager().hook


@pytest.fixture(scope="session")
def test_dtype(platform: Platform) -> torch.dtype:
    """float32 where the platform runs it (exact comparisons), else its default dtype."""
    return torch.float32 if torch.float32 in platform.supported_dtypes() \
        else platform.default_dtype()


def suite_model_info(dtype: torch.dtype) -> ModelInfo:
    """The layer shape the suite asks the platform for: 8 query heads over 2 KV heads of 64."""
    return ModelInfo("LlamaForCausalLM", dtype, dtype, head_size=64, num_heads=8,
                     num_kv_heads=2, block_size=16)


@pytest.fixture(scope="session")
def model_info(test_dtype: torch.dtype) -> ModelInfo:
    return suite_model_info(test_dtype)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))
