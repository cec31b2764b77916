"""glibc's malloc knobs the CPU platform raises, and the ones it leaves to the user."""
import platform

import pytest

from runtime.platforms.cpu import heap


def test_a_knob_the_environment_sets_is_the_users():
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536"}
    assert heap.user_set(heap.M_MMAP_THRESHOLD, tunables)
    assert not heap.user_set(heap.M_TRIM_THRESHOLD, tunables)
    assert heap.user_set(heap.M_TRIM_THRESHOLD, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not heap.user_set(heap.M_MMAP_THRESHOLD, {})


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_keep_freed_pages_sets_only_what_the_user_did_not(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert heap.keep_freed_pages() == {"mmap_threshold": heap.MMAP_THRESHOLD}
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert heap.keep_freed_pages() == {"mmap_threshold": heap.MMAP_THRESHOLD,
                                       "trim_threshold": heap.TRIM_THRESHOLD}
