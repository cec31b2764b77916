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
    """An importable `flashinfer` whose paged decode and prefill wrappers run FlashInfer's
    documented semantics in plain torch (pages through indptr/indices/last-page lengths, the
    causal mask aligned to each sequence's end, `window_left`, `sm_scale`, `logits_soft_cap`)
    from their last plan. Returns the list every `plan` call's arguments are appended to, with
    `kind` "decode" or "prefill"."""
    plans: list[dict] = []

    def attend(a: dict, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor],
               qo_indptr: list[int]) -> torch.Tensor:
        k_cache, v_cache = paged_kv
        group = a["num_qo_heads"] // a["num_kv_heads"]
        out = torch.empty_like(q)
        for i in range(len(qo_indptr) - 1):
            pages = a["kv_indices"][a["kv_indptr"][i]:a["kv_indptr"][i + 1]]
            kv_len = (len(pages) - 1) * a["page_size"] + a["last"][i]
            k, v = (c[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1).float()
                    for c in (k_cache, v_cache))
            lo, hi = qo_indptr[i], qo_indptr[i + 1]
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

    def record(kind: str, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
               page_size, **kw) -> dict:
        args = dict(kind=kind, kv_indptr=kv_indptr.tolist(), kv_indices=kv_indices.tolist(),
                    last=last_page_len.tolist(), num_qo_heads=num_qo_heads,
                    num_kv_heads=num_kv_heads, page_size=page_size, **kw)
        plans.append(args)
        return args

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                     use_cuda_graph: bool = False) -> None:
            assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
            self.args: dict = {}

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                 num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kw) -> None:
            self.args = record("prefill", paged_kv_indptr, paged_kv_indices,
                               paged_kv_last_page_len, num_qo_heads, num_kv_heads, page_size,
                               qo_indptr=qo_indptr.tolist(), **kw)

        def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]):
            return attend(self.args, q, paged_kv_cache, self.args["qo_indptr"])

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                     use_cuda_graph: bool = False, use_tensor_cores: bool = False) -> None:
            assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
            self.use_tensor_cores = use_tensor_cores
            self.args: dict = {}

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                 q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
                 rope_scale=None, rope_theta=None, non_blocking=True) -> None:
            self.args = record("decode", indptr, indices, last_page_len, num_qo_heads,
                               num_kv_heads, page_size, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                               kv_data_type=kv_data_type, sm_scale=sm_scale,
                               use_tensor_cores=self.use_tensor_cores)

        def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]):
            return attend(self.args, q, paged_kv_cache, list(range(q.size(0) + 1)))

    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return plans


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, kv_len: int, scale: float, causal: bool,
                     window: tuple[int, int], softcap: float) -> torch.Tensor:
    """One sequence's attention as FlashAttention defines it: q [Lq, H, D] over the first
    `kv_len` positions of its pages, the causal mask and window aligned to the sequence's end."""
    page = k_cache.size(1)
    pages = table[:-(-kv_len // page)].long()
    group = q.size(1) // k_cache.size(2)
    k, v = (c[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1).float()
            for c in (k_cache, v_cache))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(kv_len - q.size(0), kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    visible = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
    if window[0] >= 0:
        visible &= k_pos >= q_pos - window[0]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _check_flash_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor | None) -> None:
    """The checks flash-attn 2's C++ entry points make before a paged call."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if block_table is not None:
        if block_table.dtype != torch.int32:
            raise RuntimeError("block_table must have dtype torch.int32")
        if k_cache.size(1) % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")


def fake_flash_attn(monkeypatch) -> list[str]:
    """An importable `flash_attn` whose `flash_attn_varlen_func` and `flash_attn_with_kvcache`
    have flash-attn 2.7's signatures, make its input checks and compute its documented paged
    semantics in plain torch. Returns the list each call's function name is appended to."""
    calls: list[str] = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        _check_flash_inputs(q, k, v, block_table)
        assert block_table is not None and dropout_p == 0.0 and alibi_slopes is None
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        calls.append("flash_attn_varlen_func")
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.empty_like(q)
        for i in range(len(starts_q) - 1):
            lo, hi = starts_q[i], starts_q[i + 1]
            kv_len = starts_k[i + 1] - starts_k[i]
            assert hi - lo <= max_seqlen_q and kv_len <= max_seqlen_k
            out[lo:hi] = _paged_attention(q[lo:hi], k, v, block_table[i], kv_len,
                                          softmax_scale, causal, window_size, softcap)
        return out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        _check_flash_inputs(q, k_cache, v_cache, block_table)
        assert k is None and v is None and rotary_cos is None and cache_batch_idx is None
        if cache_seqlens is None or cache_seqlens.dtype != torch.int32:
            raise RuntimeError("cache_seqlens must have dtype int32")
        calls.append("flash_attn_with_kvcache")
        out = torch.empty_like(q)  # [batch, q_len, heads, head_size]
        for i, kv_len in enumerate(cache_seqlens.tolist()):
            if kv_len:
                out[i] = _paged_attention(q[i], k_cache, v_cache, block_table[i], kv_len,
                                          softmax_scale, causal, window_size, softcap)
            else:
                out[i] = 0
        return out

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls
