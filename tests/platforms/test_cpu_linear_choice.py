import json

import pytest
import torch

from runtime.platforms.cpu import linear_choice, ops
from runtime.platforms.cpu.linear_choice import PackedRows

LARGE = (512, 1024)  # in, out: large enough to be timed itself


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    """An empty cache root and no choice remembered by this process."""
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ops.ONEDNN_ENV, raising=False)
    linear_choice._packed_rows.cache_clear()
    yield tmp_path
    linear_choice._packed_rows.cache_clear()


def test_rows_take_the_choice_of_their_bucket():
    choice = PackedRows([4, 8, 16, 2048])
    assert [r in choice for r in (1, 3, 4, 7, 31, 32, 2047, 2048, 9000)] == \
        [False, False, True, True, True, False, False, True, True]
    assert choice.describe() == "4-31, 2048+"
    assert PackedRows([]).describe() == "none"
    assert PackedRows([1, 2]).describe() == "1-3"


def test_the_measurement_is_cached_per_host_thread_count_and_shape(fresh_choices, monkeypatch):
    calls = []
    monkeypatch.setattr(linear_choice, "measure_packed_buckets",
                        lambda shape: calls.append(shape) or [16, 32])
    assert linear_choice.fp32_packed_rows(3, *LARGE).packed_buckets == [16, 32]
    linear_choice._packed_rows.cache_clear()  # a new process reads the file
    assert linear_choice.fp32_packed_rows(3, *LARGE).packed_buckets == [16, 32]
    assert calls == [LARGE]
    (saved,) = (fresh_choices / "cpu_linear").iterdir()
    assert json.loads(saved.read_text()) == {"threads": 3, "shape": list(LARGE),
                                             "packed_buckets": [16, 32]}
    linear_choice.fp32_packed_rows(5, *LARGE)  # another thread count is measured anew
    linear_choice.fp32_packed_rows(3, 1024, 512)  # and another shape
    assert calls == [LARGE, LARGE, (1024, 512)]


def test_small_weights_take_the_reference_shapes_choice(fresh_choices, monkeypatch):
    calls = []
    monkeypatch.setattr(linear_choice, "measure_packed_buckets",
                        lambda shape: calls.append(shape) or [4])
    assert linear_choice.fp32_packed_rows(2, 64, 128).packed_buckets == [4]
    assert linear_choice.fp32_packed_rows(2, 128, 64).packed_buckets == [4]
    assert calls == [linear_choice.REFERENCE_SHAPE]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_rows_past_the_timing_budget_take_the_largest_timed_choice(monkeypatch):
    timed = []
    real = linear_choice._seconds
    monkeypatch.setattr(linear_choice, "SECONDS_PER_TIMING", 1e-4)
    monkeypatch.setattr(linear_choice, "MAX_TIMED_FLOP", 2 * 64 * 32 * 48)
    monkeypatch.setattr(linear_choice, "_seconds", lambda fn: timed.append(1) or real(fn))
    buckets = linear_choice.measure_packed_buckets((32, 48))
    assert len(timed) == 2 * linear_choice.ROW_BUCKETS.index(64) + 2  # 1-64 rows, both products
    larger = [b for b in linear_choice.ROW_BUCKETS if b > 64]
    assert all(b in buckets for b in larger) or not any(b in buckets for b in larger)
    assert (64 in buckets) == (128 in buckets)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_the_dense_kernel_follows_its_shapes_choice(fresh_choices, monkeypatch):
    packed_calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear_choice, "measure_packed_buckets",
                        lambda shape: [4] if shape == LARGE else [1, 8])
    weight, x = torch.randn(LARGE[1], LARGE[0]), torch.randn(64, LARGE[0])
    dense = ops.linear(weight)
    small_weight, small_x = torch.randn(48, 32), torch.randn(64, 32)
    small = ops.linear(small_weight)  # the reference shape's choice: 1-3 and 8-15 rows
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: packed_calls.append(a[0].size(-1)) or real(*a))
    for rows in (1, 4, 7, 8):
        got = dense(x[:rows], None)
        torch.testing.assert_close(got, x[:rows] @ weight.T, atol=1e-3, rtol=1e-4)
        got = small(small_x[:rows], None)
        torch.testing.assert_close(got, small_x[:rows] @ small_weight.T, atol=1e-4, rtol=1e-4)
    assert packed_calls == [32, LARGE[0], LARGE[0], 32]
    monkeypatch.setattr(linear_choice, "measure_packed_buckets", lambda shape: [])
    linear_choice._packed_rows.cache_clear()
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(fresh_choices / "other"))
    assert ops.onednn_rows(weight) is None  # nothing wins: no packed copy at all
    monkeypatch.setenv(ops.ONEDNN_ENV, "1")
    assert 1 in ops.onednn_rows(weight)
