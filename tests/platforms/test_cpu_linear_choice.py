import json

import pytest
import torch

from runtime.platforms.cpu import linear_choice, ops
from runtime.platforms.cpu.linear_choice import PackedRows


def test_rows_take_the_choice_of_their_bucket():
    choice = PackedRows([4, 8, 16, 2048])
    assert [r in choice for r in (1, 3, 4, 7, 31, 32, 2047, 2048, 9000)] == \
        [False, False, True, True, True, False, False, True, True]
    assert choice.describe() == "4-31, 2048+"
    assert PackedRows([]).describe() == "none"
    assert PackedRows([1, 2]).describe() == "1-3"


def test_the_measurement_is_cached_per_host_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(linear_choice, "measure_packed_buckets",
                        lambda: calls.append(1) or [16, 32])
    linear_choice.fp32_packed_rows.cache_clear()
    try:
        assert linear_choice.fp32_packed_rows(3).packed_buckets == [16, 32]
        linear_choice.fp32_packed_rows.cache_clear()  # a new process reads the file
        assert linear_choice.fp32_packed_rows(3).packed_buckets == [16, 32]
        assert len(calls) == 1
        (saved,) = (tmp_path / "cpu_linear").iterdir()
        assert json.loads(saved.read_text()) == {"threads": 3, "packed_buckets": [16, 32]}
        linear_choice.fp32_packed_rows(5)  # another thread count is measured anew
        assert len(calls) == 2
    finally:
        linear_choice.fp32_packed_rows.cache_clear()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_the_dense_kernel_follows_the_measured_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ops.ONEDNN_ENV, raising=False)
    linear_choice.fp32_packed_rows.cache_clear()
    packed_calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear_choice, "measure_packed_buckets", lambda: [4])
    try:
        weight, x = torch.randn(48, 32), torch.randn(64, 32)
        dense = ops.linear(weight)
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda *a: packed_calls.append(a[0].size(0)) or real(*a))
        for rows in (1, 4, 7, 8):
            got = dense(x[:rows], None)
            torch.testing.assert_close(got, x[:rows] @ weight.T, atol=1e-4, rtol=1e-4)
        assert packed_calls == [4, 7]
        monkeypatch.setattr(linear_choice, "measure_packed_buckets", lambda: [])
        linear_choice.fp32_packed_rows.cache_clear()
        monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "other"))
        assert ops.onednn_rows(torch.float32) is None  # nothing wins: no packed copies at all
        monkeypatch.setenv(ops.ONEDNN_ENV, "1")
        assert 1 in ops.onednn_rows(torch.float32)
    finally:
        linear_choice.fp32_packed_rows.cache_clear()

