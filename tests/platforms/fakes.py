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


class FakeDeviceState:
    """torch.cuda's (or torch.xpu's) current device for fake GPUs: `set_device` switches it,
    `current_device` reads it, and each memory query is logged with the device it asked about
    (`calls`), so a test sees which device each rank used."""

    def __init__(self, monkeypatch, module=torch.cuda, free: int = 60 * GiB,
                 total: int = 80 * GiB) -> None:
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        self.memory = (free, total)
        for name, fn in (("set_device", self.set_device), ("current_device", lambda: self.current),
                         ("mem_get_info", self.mem_get_info), ("memory_reserved", lambda d: 0)):
            monkeypatch.setattr(module, name, fn, raising=False)

    def set_device(self, device) -> None:
        self.current = torch.device(device).index
        self.calls.append(("set_device", self.current))

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self.calls.append(("mem_get_info", device))
        return self.memory


def fake_flashinfer(monkeypatch) -> list[dict]:
    """An importable `flashinfer` whose paged prefill wrapper runs FlashInfer's documented
    semantics in plain torch (pages through indptr/indices/last-page lengths, causal mask
    aligned to each sequence's end, `window_left`, `sm_scale`, `logits_soft_cap`) from its
    last plan. Returns the list every `plan` call's arguments are appended to."""
    plans: list[dict] = []

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
            assert kv_layout == "NHD" and workspace.dtype == torch.uint8
            self.args: dict = {}

        def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads,
                 num_kv_heads, head_dim, page_size, **kw) -> None:
            self.args = dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                             kv_indices=kv_indices.tolist(), last=last_page_len.tolist(),
                             num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                             page_size=page_size, **kw)
            plans.append(self.args)

        def run(self, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor]):
            a, (k_cache, v_cache) = self.args, paged_kv
            group = a["num_qo_heads"] // a["num_kv_heads"]
            out = torch.empty_like(q)
            for i in range(len(a["qo_indptr"]) - 1):
                pages = a["kv_indices"][a["kv_indptr"][i]:a["kv_indptr"][i + 1]]
                kv_len = (len(pages) - 1) * a["page_size"] + a["last"][i]
                k, v = (c[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1).float()
                        for c in (k_cache, v_cache))
                lo, hi = a["qo_indptr"][i], a["qo_indptr"][i + 1]
                scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * a["sm_scale"]
                if a["logits_soft_cap"]:
                    scores = a["logits_soft_cap"] * torch.tanh(scores / a["logits_soft_cap"])
                q_pos = torch.arange(kv_len - (hi - lo), kv_len)[:, None]
                k_pos = torch.arange(kv_len)[None, :]
                visible = k_pos <= q_pos
                if a["window_left"] >= 0:
                    visible &= k_pos >= q_pos - a["window_left"]
                probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
            return out

    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return plans
