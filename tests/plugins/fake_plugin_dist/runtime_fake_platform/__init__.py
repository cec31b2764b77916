"""A fake device, "fakedev", that really runs on the CPU, plus a model and a custom op.

Env knobs for the tests: RUNTIME_FAKE_PRIORITY (default 10, above the cpu platform's 0) and
RUNTIME_FAKE_USABLE=0 (detected as absent).
"""
from __future__ import annotations

import os

import torch

from runtime.plugins.hookspecs import HOOK_API_VERSION, hookimpl
from runtime.plugins.interfaces import Platform, PlatformCandidate

RUNTIME_HOOK_API_VERSION = HOOK_API_VERSION


class FakePlatform(Platform):
    name = "fakedev"
    device_type = "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        return requested or 64 << 20

    def describe(self) -> dict:
        return {"device": "fake accelerator (runs on the host)"}


class FakeModel:
    """A stand-in architecture, imported by its "module:Class" string."""


def fake_op(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@hookimpl
def runtime_detect_platforms():
    priority = int(os.environ.get("RUNTIME_FAKE_PRIORITY", "10"))
    if os.environ.get("RUNTIME_FAKE_USABLE", "1") == "0":
        return [PlatformCandidate("fakedev", None, priority, "no fake device attached")]
    return [PlatformCandidate("fakedev", FakePlatform(), priority)]


@hookimpl
def runtime_register_models():
    return {"FakeForCausalLM": "runtime_fake_platform:FakeModel"}


@hookimpl
def runtime_custom_op(platform, name):
    return fake_op if name == "fake_op" else None
