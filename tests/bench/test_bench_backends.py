"""The backends' process plumbing: allocator detection and each backend's environment."""
from __future__ import annotations

import os

from runtime.bench import backends


def test_allocator_reports_the_glibc_threshold(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1:"
                                         "glibc.malloc.mmap_threshold=33554432")
    if "jemalloc" not in backends.allocator():  # unless this process runs under one
        assert backends.allocator() == "glibc (mmap_threshold=33554432)"
        monkeypatch.delenv("GLIBC_TUNABLES")
        assert backends.allocator() == "glibc (default mmap threshold)"


def test_vllm_gets_our_cores_and_no_reserved_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert backends.cpu_list(3) == "0-2"
    assert backends.cpu_list(4) == "0,1,2,5"
    env = backends.child_env({"backend": "vllm", "num_threads": 2})
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["OMP_NUM_THREADS"] == "2"
    assert "VLLM_TARGET_DEVICE" not in backends.child_env({"backend": "hf", "num_threads": 1})


def test_busy_machine_warning():
    from runtime.bench.common import busy_warning
    assert busy_warning({"load_average": 0.3, "cores": 2}) is None
    assert "busy" in busy_warning({"load_average": 6.5, "cores": 2})
