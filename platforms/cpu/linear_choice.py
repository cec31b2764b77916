"""Which float32 dense products run on oneDNN with a pre-packed weight, and which on torch's own
product (MKL's sgemm on x86, which re-packs the weight every call), chosen per weight shape by
timing both on this host once per shape, thread count and torch build, cached under the cache
root.

No fixed rule holds across hosts: on a 2-core AVX2 EPYC the packed product won only for 8-256
rows on two threads; on a 2-core AVX-512 EPYC without AMX (MKL takes no AVX-512 path on AMD) it
won 2-5x at every row count from 4 to 2048, on one thread and on two; on an AMX Xeon MKL's sgemm
is strong on long prefill chunks; and on one host the winner at a row count differs between
shapes (the AVX2 EPYC at 2048 rows: MKL 6-15 % faster on three of SmolLM2's projections, 7 %
slower on its 576 x 960 qkv).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

from runtime.plugins.paths import cache_dir

logger = logging.getLogger(__name__)

# Row counts timed; a product of r rows takes the choice of the largest bucket <= r.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# (in_features, out_features): a mid-sized projection, whose choice the weights too small to
# be worth a measurement of their own take.
REFERENCE_SHAPE = (1024, 2048)
MIN_MEASURED_ELEMENTS = 1 << 18  # a weight this large (1 MiB in float32) is timed itself
MAX_TIMED_FLOP = 2e9  # larger buckets (a few tens of ms a call) take the largest timed one's
SECONDS_PER_TIMING = 0.004


class PackedRows:
    """The row counts whose product runs packed: `rows in choice`."""

    def __init__(self, packed_buckets: list[int]) -> None:
        self.packed_buckets = sorted(packed_buckets)

    def __contains__(self, rows: int) -> bool:
        bucket = max((b for b in ROW_BUCKETS if b <= rows), default=ROW_BUCKETS[0])
        return bucket in self.packed_buckets

    def describe(self) -> str:
        """`4-2048+` style: the bucket ranges that run packed."""
        if not self.packed_buckets:
            return "none"
        spans, start, last = [], None, None
        for bucket in ROW_BUCKETS:
            if bucket in self.packed_buckets:
                start = bucket if start is None else start
                last = bucket
            elif start is not None:
                spans.append((start, last))
                start = None
        if start is not None:
            spans.append((start, None))
        upper = {b: ROW_BUCKETS[i + 1] - 1 for i, b in enumerate(ROW_BUCKETS[:-1])}
        return ", ".join(f"{lo}+" if hi is None else f"{lo}-{upper[hi]}" for lo, hi in spans)


def _seconds(fn) -> float:
    """The best of three timings of `fn`, each over enough calls to last a few milliseconds."""
    fn()
    begin = time.perf_counter()
    fn()
    once = max(time.perf_counter() - begin, 1e-7)
    calls = max(1, int(SECONDS_PER_TIMING / once))
    best = float("inf")
    for _ in range(3):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - begin) / calls)
    return best


def measure_packed_buckets(shape: tuple[int, int]) -> list[int]:
    """Time both products of a weight of `shape` (in_features, out_features) at each bucket on
    the current thread count; the buckets where the packed one is faster. A bucket over
    MAX_TIMED_FLOP takes the choice of the largest one under it."""
    k, n = shape
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    buckets, packed_wins = [], False
    for rows in ROW_BUCKETS:
        if rows == 1 or 2 * rows * k * n <= MAX_TIMED_FLOP:
            x = torch.randn(rows, k, generator=generator)
            mkl = _seconds(lambda: F.linear(x, weight))
            onednn = _seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            packed_wins = onednn < mkl
        if packed_wins:
            buckets.append(rows)
    return buckets


def measured_shape(in_features: int, out_features: int) -> tuple[int, int]:
    """The shape whose timing decides for a weight of this shape: its own, or the reference
    shape's for a small one."""
    if in_features * out_features >= MIN_MEASURED_ELEMENTS:
        return in_features, out_features
    return REFERENCE_SHAPE


def host_key(threads: int) -> str:
    """What the choice depends on: the CPU (its first entry in /proc/cpuinfo: model and
    flags), torch's build, the ISA oneDNN may use, the thread count."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = f.read().split("\n\n", 1)[0]
    except OSError:
        cpu = ""
    described = [line for line in cpu.splitlines() if line.startswith(("model name", "flags"))]
    text = "|".join([*described, torch.backends.cpu.get_cpu_capability(), torch.__version__,
                     os.environ.get("ONEDNN_MAX_CPU_ISA", ""), str(threads)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def fp32_packed_rows(threads: int, in_features: int, out_features: int) -> PackedRows:
    """The float32 row counts at which a weight of this shape runs packed on `threads`
    threads."""
    return _packed_rows(threads, measured_shape(in_features, out_features))


@lru_cache(maxsize=None)
def _packed_rows(threads: int, shape: tuple[int, int]) -> PackedRows:
    """`shape`'s choice on `threads` threads: read from the cache, else measured (about a
    second) and cached. Logged either way."""
    k, n = shape
    path = cache_dir("cpu_linear", f"fp32-{host_key(threads)}-{k}x{n}.json")
    source = "cached"
    try:
        buckets = json.loads(path.read_text())["packed_buckets"]
    except (OSError, ValueError, KeyError):
        begin = time.perf_counter()
        buckets = measure_packed_buckets(shape)
        source = f"measured in {time.perf_counter() - begin:.1f} s"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"threads": threads, "shape": [k, n],
                                   "packed_buckets": buckets}))
        os.replace(tmp, path)
    choice = PackedRows(buckets)
    logger.info("float32 dense products of %d x %d on %d thread(s): oneDNN with packed weights "
                "for %s rows, torch's product for the rest (%s on this host: %s)", k, n, threads,
                choice.describe(), source, path)
    return choice
