import json
import os
import subprocess
import sys
import time

import pytest
import torch

from runtime.platforms.cpu import linear_choice, ops
from runtime.platforms.cpu.linear_choice import ROW_BUCKETS, ProductChoice

LARGE = (512, 1024)  # in, out: large enough to be timed itself


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    """An empty cache root, no choice remembered by this process, and CPUs no other process
    keeps busy (the suite's own parallel workers would)."""
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ops.LINEAR_ENV, raising=False)
    monkeypatch.setattr(linear_choice, "others_load_while", lambda fn: (fn(), 0.0))
    monkeypatch.setattr(linear_choice, "others_load_now", lambda: 0.0)
    linear_choice._products.cache_clear()
    yield tmp_path
    linear_choice._products.cache_clear()


def fp32_products(threads: int, in_features: int, out_features: int) -> ProductChoice:
    return linear_choice.timed_products(threads, torch.float32, in_features, out_features,
                                        linear_choice.candidates())


def by_bucket(**spans: int) -> dict[int, str]:
    """{bucket: product} from `product=first bucket` pairs, in bucket order."""
    starts = sorted((first, name) for name, first in spans.items())
    return {b: [name for first, name in starts if first <= b][-1] for b in ROW_BUCKETS}


def test_rows_take_the_choice_of_their_bucket():
    choice = ProductChoice(by_bucket(torch=1, dense=4, onednn=32))
    assert [choice.product(r) for r in (1, 3, 4, 31, 32, 2047, 2048, 9000)] == \
        ["torch", "torch", "dense", "dense", "onednn", "onednn", "onednn", "onednn"]
    assert choice.describe() == "torch for 1-3, dense for 4-31, onednn for 32+ rows"
    assert choice.products() == {"torch", "dense", "onednn"}
    assert ProductChoice.everywhere("dense").describe() == "dense for 1+ rows"


def test_the_measurement_is_cached_per_host_thread_count_and_shape(fresh_choices, monkeypatch):
    calls = []
    chosen = by_bucket(onednn=1, dense=16)
    monkeypatch.setattr(linear_choice, "measure_products",
                        lambda shape, products, dtype: calls.append(shape) or chosen)
    assert fp32_products(3, *LARGE).by_bucket == chosen
    linear_choice._products.cache_clear()  # a new process reads the file
    assert fp32_products(3, *LARGE).by_bucket == chosen
    assert calls == [LARGE]
    (saved,) = (fresh_choices / "cpu_linear").iterdir()
    assert json.loads(saved.read_text()) == {
        "threads": 3, "shape": list(LARGE), "products": {str(b): p for b, p in chosen.items()}}
    fp32_products(5, *LARGE)  # another thread count is measured anew
    fp32_products(3, 1024, 512)  # and another shape
    assert calls == [LARGE, LARGE, (1024, 512)]


def test_a_choice_timed_on_busy_cpus_is_timed_again_once_they_are_quiet(fresh_choices,
                                                                           monkeypatch):
    calls, load = [], {"while": 1.3, "now": 0.0}
    choices = iter([by_bucket(onednn=1), by_bucket(dense=1)])
    monkeypatch.setattr(linear_choice, "measure_products",
                        lambda shape, products, dtype: calls.append(shape) or next(choices))
    monkeypatch.setattr(linear_choice, "others_load_while", lambda fn: (fn(), load["while"]))
    monkeypatch.setattr(linear_choice, "others_load_now", lambda: load["now"])
    assert fp32_products(2, *LARGE).product(64) == "onednn"
    (saved,) = (fresh_choices / "cpu_linear").iterdir()
    assert json.loads(saved.read_text())["busy"] == 1.3
    load["now"] = 0.9  # the next process starts while the CPUs are still busy: no new timing
    linear_choice._products.cache_clear()
    assert fp32_products(2, *LARGE).product(64) == "onednn"
    assert calls == [LARGE]
    load["now"] = load["while"] = 0.1  # a quiet start times it again and trusts that timing
    linear_choice._products.cache_clear()
    assert fp32_products(2, *LARGE).product(64) == "dense"
    assert calls == [LARGE, LARGE] and "busy" not in json.loads(saved.read_text())
    linear_choice._products.cache_clear()
    assert fp32_products(2, *LARGE).product(64) == "dense"
    assert calls == [LARGE, LARGE]


def test_the_load_of_other_processes_is_measured():
    """A busy loop on one of this process's CPUs shows up both ways: at least half a core more
    than the load measured before it started (the suite may be running beside this test)."""
    quiet = linear_choice.others_load_now()
    result, while_quiet = linear_choice.others_load_while(lambda: 42)
    assert result == 42 and while_quiet >= 0.0
    cpu = min(os.sched_getaffinity(0))  # one of the CPUs this process may run on
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)
        assert linear_choice.others_load_now(0.3) >= min(quiet + 0.5, 0.9)
        _, busy = linear_choice.others_load_while(lambda: time.sleep(0.3))
        assert busy >= 0.5
    finally:
        spinner.kill()
        spinner.wait()


def test_the_candidates_and_the_kernel_source_are_part_of_the_key():
    assert linear_choice.host_key(2, ("torch", "onednn")) != \
        linear_choice.host_key(2, ("torch", "onednn", "dense"))
    assert linear_choice.host_key(2, ("torch",)) == linear_choice.host_key(2, ("torch",))


def test_small_weights_take_the_reference_shapes_choice(fresh_choices, monkeypatch):
    calls = []
    monkeypatch.setattr(linear_choice, "measure_products",
                        lambda shape, products, dtype: calls.append(shape) or by_bucket(torch=1))
    assert fp32_products(2, 64, 128).product(64) == "torch"
    assert fp32_products(2, 128, 64).product(64) == "torch"
    assert calls == [linear_choice.REFERENCE_SHAPE]


def test_rows_past_the_timing_budget_take_the_largest_timed_choice(monkeypatch):
    timed = []
    real = linear_choice._fastest
    products = linear_choice.candidates()
    monkeypatch.setattr(linear_choice, "SECONDS_PER_TIMING", 1e-4)
    monkeypatch.setattr(linear_choice, "MAX_TIMED_FLOP", 2 * 64 * 32 * 48)
    monkeypatch.setattr(linear_choice, "_fastest", lambda fns: timed.append(set(fns)) or real(fns))
    chosen = linear_choice.measure_products((32, 48), products, torch.float32)
    assert timed == [set(products)] * (ROW_BUCKETS.index(64) + 1)  # 1-64 rows, all products
    assert {chosen[b] for b in ROW_BUCKETS if b >= 64} == {chosen[64]}
    assert set(chosen.values()) <= set(products)


def test_the_timing_reads_each_weight_from_memory(monkeypatch):
    """The calls take turns over copies of the weight twice the last-level cache's size, as a
    model's step reads each weight after the others have passed through the caches."""
    used = []
    real_prepare = linear_choice.prepare

    def recording(name, weight):
        kernel = real_prepare(name, weight)
        return lambda x, bias: used.append(weight.data_ptr()) or kernel(x, bias)
    monkeypatch.setattr(linear_choice, "prepare", recording)
    monkeypatch.setattr(linear_choice, "last_level_cache_bytes", lambda: 3 * 32 * 48 * 4)
    monkeypatch.setattr(linear_choice, "SECONDS_PER_TIMING", 1e-4)
    monkeypatch.setattr(linear_choice, "MAX_TIMED_FLOP", 0)  # one row timed, the rest take it
    chosen = linear_choice.measure_products((32, 48), ("torch",), torch.float32)
    assert set(chosen.values()) == {"torch"}
    assert len(set(used)) == 6 and all(a != b for a, b in zip(used, used[1:]))


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "16384K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert linear_choice.last_level_cache_bytes(tmp_path) == 16 << 20
    assert linear_choice.last_level_cache_bytes(tmp_path / "missing") == 32 << 20


def test_the_fastest_is_found_across_interleaved_rounds():
    slow = lambda: time.sleep(0.002)  # noqa: E731
    assert linear_choice._fastest({"slow": slow, "fast": lambda: None, "slower": lambda: slow()
                                   or slow()}) == "fast"


def test_every_candidate_computes_the_product():
    weight, x, bias = torch.randn(40, 24), torch.randn(5, 24), torch.randn(40)
    for name in linear_choice.candidates():
        got = linear_choice.prepare(name, weight)(x, bias)
        torch.testing.assert_close(got, x @ weight.T + bias, atol=1e-4, rtol=1e-4)


def test_the_dense_layer_follows_its_shapes_choice(fresh_choices, monkeypatch):
    packed = linear_choice.candidates()[-1]  # oneDNN's or `dense`
    if packed == "torch":
        pytest.skip("torch's product is this host's only one")
    ran = []
    real_prepare = linear_choice.prepare

    def recording(name, weight):
        kernel = real_prepare(name, weight)

        def run(x, bias):
            ran.append((name, x.size(0)))
            return kernel(x, bias)
        return run
    monkeypatch.setattr(ops, "prepare", recording)
    monkeypatch.setattr(linear_choice, "measure_products", lambda shape, products, dtype: by_bucket(
        **({"torch": 1, packed: 4} if shape == LARGE else {packed: 1, "torch": 8})))
    weight, x = torch.randn(LARGE[1], LARGE[0]), torch.randn(64, LARGE[0])
    layer = ops.linear(weight)
    small_weight, small_x = torch.randn(48, 32), torch.randn(64, 32)
    small = ops.linear(small_weight)  # the reference shape's choice: packed for 1-7 rows
    for rows in (1, 4, 7, 8):
        torch.testing.assert_close(layer(x[:rows], None), x[:rows] @ weight.T,
                                   atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(small(small_x[:rows], None), small_x[:rows] @ small_weight.T,
                                   atol=1e-4, rtol=1e-4)
    assert ran == [(packed, 1), (packed, 4), (packed, 4), (packed, 7), (packed, 7), (packed, 8)]
    layer(x[:8].T.contiguous().T, None)  # a strided input takes torch's product
    assert len(ran) == 6


def test_a_forced_product_is_checked_against_the_hosts(fresh_choices, monkeypatch):
    monkeypatch.setenv(ops.LINEAR_ENV, "torch")
    assert ops.dense_products(torch.randn(64, 32)).products() == {"torch"}
    monkeypatch.setenv(ops.LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="RUNTIME_CPU_LINEAR='mkl': float32 layers on this "
                                         "host run torch"):
        ops.dense_products(torch.randn(64, 32))
    monkeypatch.setenv(ops.LINEAR_ENV, "torch")
    assert ops.dense_products(torch.randn(64, 32).bfloat16()).products() == {"torch"}
    monkeypatch.setenv(ops.LINEAR_ENV, "dense")  # float32 and bfloat16 only
    with pytest.raises(ValueError, match="float16 layers on this host run torch"):
        ops.dense_products(torch.randn(64, 32).half())
    assert not (fresh_choices / "cpu_linear").exists()  # nothing timed


def test_bf16_layers_are_timed_where_dense_takes_bf16(fresh_choices, monkeypatch):
    """bf16 weights choose between oneDNN's packed product and `dense` by timing, in a cache
    file of their own; where `dense` has no bf16 path they take oneDNN's untimed."""
    calls = []
    monkeypatch.setattr(linear_choice, "measure_products", lambda shape, products, dtype:
                        calls.append((shape, products, dtype)) or by_bucket(dense=1, onednn=64))
    choice = ops.dense_products(torch.randn(LARGE[1], LARGE[0]).bfloat16())
    if "dense" not in linear_choice.candidates(torch.bfloat16):
        assert choice.products() <= {"onednn", "torch"} and calls == []
        return
    assert calls == [(LARGE, ("onednn", "dense"), torch.bfloat16)]
    assert choice.product(16) == "dense" and choice.product(64) == "onednn"
    (saved,) = (fresh_choices / "cpu_linear").iterdir()
    assert saved.name.startswith("bf16-")
