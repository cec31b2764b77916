"""Fake devices at the detection boundary only: what torch.cuda / torch.xpu / torch_xla report,
and which libraries are installed. Everything above that boundary is the real code."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from types import SimpleNamespace

import torch

GiB = 1 << 30
H100 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * GiB)
A100 = dict(name="NVIDIA A100-SXM4-40GB", major=8, minor=0, total_memory=40 * GiB)
T4 = dict(name="Tesla T4", major=7, minor=5, total_memory=16 * GiB)
MI300X = dict(name="AMD Instinct MI300X", major=9, minor=4, total_memory=192 * GiB,
              gcnArchName="gfx942:sramecc+:xnack-")
MI355X = dict(name="AMD Instinct MI355X", major=9, minor=5, total_memory=288 * GiB,
              gcnArchName="gfx950:sramecc+:xnack-")
MAX1550 = dict(name="Intel(R) Data Center GPU Max 1550", total_memory=64 * GiB)


def fake_gpus(monkeypatch, props: list[dict], cuda: str | None = "12.4",
              hip: str | None = None) -> None:
    """torch built for CUDA (or HIP) that sees these devices."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(**props[i]))


def fake_xpus(monkeypatch, props: list[dict]) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.xpu, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i: SimpleNamespace(**props[i]))


def fake_libraries(monkeypatch, installed=(), missing=()) -> None:
    """Make `installed` importable-looking and `missing` absent for import probes."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        if name in installed:
            return importlib.machinery.ModuleSpec(name, None)
        if name in missing or name.split(".")[0] in missing:
            return None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def fake_torch_xla(monkeypatch, device_type: str = "TPU", count: int = 4,
                   ragged_kernel=None) -> None:
    """A torch_xla whose PJRT runtime reports `device_type` with `count` devices."""
    modules = {name: types.ModuleType(name) for name in (
        "torch_xla", "torch_xla.runtime", "torch_xla.experimental",
        "torch_xla.experimental.custom_kernel")}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    runtime = modules["torch_xla.runtime"]
    runtime.device_type = lambda: device_type
    runtime.global_runtime_device_count = lambda: count
    modules["torch_xla"].runtime = runtime
    modules["torch_xla"].experimental = modules["torch_xla.experimental"]
    modules["torch_xla.experimental"].custom_kernel = modules[
        "torch_xla.experimental.custom_kernel"]
    if ragged_kernel is not None:
        modules["torch_xla.experimental.custom_kernel"].ragged_paged_attention = ragged_kernel
