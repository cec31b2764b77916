"""Which product each float32 or bfloat16 dense layer runs, chosen per dtype, weight shape and
row count by timing the candidates on this host once per shape, thread count, torch build and
kernel source, cached under the cache root (provisionally when other processes kept the CPUs
busy meanwhile). The candidates: torch's own product (float32: MKL's sgemm on x86, which
re-packs the weight every call), oneDNN's with a weight packed once, and the CPU kernels'
`dense` (csrc/dense.cpp: register tiles over a weight packed once; bfloat16 where the CPU has
AVX512-BF16) where they are built.

No fixed rule holds across hosts: on a 2-core AVX2 EPYC oneDNN's packed product won only for
8-256 rows on two threads, and `dense` beat both at every row count; on a 2-core AVX-512 EPYC
without AMX (MKL takes no AVX-512 path on AMD) oneDNN won 2-5x at every row count from 4 to
2048; on an AMX Xeon MKL's sgemm is strong on long prefill chunks; and on one host the winner at
a row count differs between shapes (the AVX2 EPYC at 2048 rows: MKL 6-15 % faster than oneDNN on
three of SmolLM2's projections, 7 % slower on its 576 x 960 qkv).
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.platforms.cpu.contention import load_sample, others_load
from runtime.platforms.cpu.threads import cpu_load
from runtime.plugins.paths import cache_dir

logger = logging.getLogger(__name__)

# Row counts timed; a product of r rows takes the choice of the largest bucket <= r.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# (in_features, out_features): a mid-sized projection, whose choice the weights too small to
# be worth a measurement of their own take.
REFERENCE_SHAPE = (1024, 2048)
MIN_MEASURED_ELEMENTS = 1 << 18  # a weight this large (1 MiB in float32) is timed itself
MAX_TIMED_FLOP = 2e9  # larger buckets (a few tens of ms a call) take the largest timed one's
SECONDS_PER_TIMING = 0.002
MAX_COPIES = 256  # of a timed weight
ROUNDS = 5
PRODUCTS = ("torch", "onednn", "dense")
# Other processes' load on this process's CPUs (cores' worth) from which a timing is not
# trusted: its choice is cached as provisional and timed again at the next quiet start. On the
# AVX2 EPYC a choice timed beside a test suite put oneDNN on 576 x 3072 from 256 rows, where
# `dense` is 14-17 % faster (64 x 512-token prompts: 96.6 -> 99.1 output tok/s once re-timed).
BUSY_CORES = 0.5
DENSE_SOURCE = Path(__file__).parent / "csrc" / "dense.cpp"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the dtypes timed


class ProductChoice:
    """The product each row count runs: `choice.product(rows)`, one of PRODUCTS."""

    def __init__(self, by_bucket: dict[int, str]) -> None:
        self.by_bucket = {b: by_bucket[b] for b in ROW_BUCKETS}

    @classmethod
    def everywhere(cls, product: str) -> ProductChoice:
        return cls({b: product for b in ROW_BUCKETS})

    def product(self, rows: int) -> str:
        """Called on every dense layer's every call: one bisection."""
        return self.by_bucket[ROW_BUCKETS[max(bisect.bisect_right(ROW_BUCKETS, rows) - 1, 0)]]

    def products(self) -> set[str]:
        return set(self.by_bucket.values())

    def describe(self) -> str:
        """`dense for 1-1023 rows, onednn for 1024+` style."""
        spans: list[list] = []
        for bucket in ROW_BUCKETS:
            if spans and spans[-1][0] == self.by_bucket[bucket]:
                spans[-1][2] = bucket
            else:
                spans.append([self.by_bucket[bucket], bucket, bucket])
        upper = {b: ROW_BUCKETS[i + 1] - 1 for i, b in enumerate(ROW_BUCKETS[:-1])}
        return ", ".join(f"{name} for {lo}+" if hi == ROW_BUCKETS[-1] else
                         f"{name} for {lo}-{upper[hi]}" for name, lo, hi in spans) + " rows"


def _fastest(kernels: dict[str, Callable[[], object]]) -> str:
    """The name of the fastest of `kernels`: each timed over enough calls to last a few
    milliseconds, in ROUNDS rounds that take them in turn (a burst of load then slows one
    round of each, not all of one), the best round counting."""
    calls = {}
    for name, fn in kernels.items():
        fn()
        begin = time.perf_counter()
        fn()
        calls[name] = max(1, int(SECONDS_PER_TIMING / max(time.perf_counter() - begin, 1e-7)))
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in kernels.items():
            begin = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - begin) / calls[name])
    return min(best, key=best.get)


def candidates(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The products this process can run on `dtype` weights: torch's always, oneDNN's where
    torch has it and (bf16, fp16) the CPU computes that dtype, `dense` where the CPU kernels are
    loaded, for float32 and (`dense_takes_bf16`) bfloat16."""
    found = ["torch"]
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
            or (dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported())):
        found.append("onednn")
    if hasattr(torch.ops.runtime_cpu, "dense") and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.runtime_cpu.dense_takes_bf16())):
        found.append("dense")
    return tuple(found)


def prepare(product: str, weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor | None],
                                                            torch.Tensor]:
    """`product`'s kernel for `weight` (out_features x in_features): its packed copy made now,
    applied to contiguous 2-D inputs."""
    if product == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        return lambda x, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if product == "dense":
        packed, out_features = torch.ops.runtime_cpu.pack_dense_weight(weight), weight.size(0)
        return lambda x, bias: torch.ops.runtime_cpu.dense(x, packed, out_features, bias)
    return lambda x, bias: F.linear(x, weight, bias)


def measure_products(shape: tuple[int, int], products: tuple[str, ...],
                     dtype: torch.dtype) -> dict[int, str]:
    """Time each of `products` on a `dtype` weight of `shape` (in_features, out_features) at
    each bucket on the current thread count; the fastest per bucket. A bucket over
    MAX_TIMED_FLOP takes the choice of the largest one under it."""
    k, n = shape
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    # As in a model's step, each call reads its weight from memory, not from a cache that the
    # previous call left it in: the calls take turns over copies that outgrow the caches twice
    # (at most MAX_COPIES, for the tiny weights only tests time: a model's take the reference
    # shape's choice).
    copies = -(-2 * last_level_cache_bytes() // (weight.numel() * weight.element_size()))
    copies = max(1, min(MAX_COPIES, copies))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    kernels = {name: [prepare(name, w) for w in weights] for name in products}
    chosen, fastest = {}, products[0]
    for rows in ROW_BUCKETS:
        if rows == 1 or 2 * rows * k * n <= MAX_TIMED_FLOP:
            x = torch.randn(rows, k, generator=generator).to(dtype)
            fastest = _fastest({name: _taking_turns(kernels[name], x) for name in products})
        chosen[rows] = fastest
    return chosen


def _taking_turns(kernels: list[Callable], x: torch.Tensor) -> Callable[[], object]:
    """A call of the next of `kernels` on `x`, round and round."""
    turns = itertools.cycle(kernels)
    return lambda: next(turns)(x, None)


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of this CPU's largest cache, from sysfs; 32 MiB where that is unreadable."""
    sizes, units = [], {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in cpu.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


def measured_shape(in_features: int, out_features: int) -> tuple[int, int]:
    """The shape whose timing decides for a weight of this shape: its own, or the reference
    shape's for a small one."""
    if in_features * out_features >= MIN_MEASURED_ELEMENTS:
        return in_features, out_features
    return REFERENCE_SHAPE


def host_key(threads: int, products: tuple[str, ...]) -> str:
    """What the choice depends on: the CPU (its first entry in /proc/cpuinfo: model and
    flags), torch's build, the ISA oneDNN may use, the thread count, the candidates, the
    `dense` kernel's source and the timing's own (this module's)."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = f.read().split("\n\n", 1)[0]
    except OSError:
        cpu = ""
    described = [line for line in cpu.splitlines() if line.startswith(("model name", "flags"))]
    dense_source = source_hash(DENSE_SOURCE) if "dense" in products else ""
    text = "|".join([*described, torch.backends.cpu.get_cpu_capability(), torch.__version__,
                     os.environ.get("ONEDNN_MAX_CPU_ISA", ""), str(threads), *products,
                     dense_source, source_hash(Path(__file__))])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def source_hash(path: Path) -> str:
    """The SHA-1 of a source file, read once a process (every timed shape's key takes it)."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


def others_load_while(fn: Callable[[], object]) -> tuple[object, float]:
    """`fn()`'s result, and the cores' worth of this process's CPUs that other processes kept
    busy while it ran (0.0 where /proc/stat is unreadable)."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        before = load_sample()
    except OSError:
        return fn(), 0.0
    result = fn()
    after = load_sample()
    return result, others_load(cpus, before[0], after[0], before[1], after[1])


def others_load_now(interval: float = 0.1) -> float:
    """The cores' worth of this process's CPUs other processes keep busy, over `interval`
    seconds of this process waiting."""
    return sum(cpu_load(sorted(os.sched_getaffinity(0)), interval).values())


def timed_products(threads: int, dtype: torch.dtype, in_features: int, out_features: int,
                   products: tuple[str, ...]) -> ProductChoice:
    """The product of `products` a `dtype` (float32, bfloat16) weight of this shape runs at each
    row count on `threads` threads."""
    return _products(threads, dtype, measured_shape(in_features, out_features), products)


@lru_cache(maxsize=None)
def _products(threads: int, dtype: torch.dtype, shape: tuple[int, int],
              products: tuple[str, ...]) -> ProductChoice:
    """`shape`'s choice among `products` on `threads` threads: read from the cache, else
    measured (about a second) and cached. A choice timed while other processes kept
    BUSY_CORES or more busy is cached as provisional: a later start times it again unless the
    CPUs are still that busy. Logged either way."""
    k, n = shape
    path = cache_dir("cpu_linear",
                     f"{DTYPE_NAMES[dtype]}-{host_key(threads, products)}-{k}x{n}.json")
    try:
        saved = json.loads(path.read_text())
        choice = ProductChoice({int(b): name for b, name in saved["products"].items()})
        busy = float(saved["busy"]) if "busy" in saved else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        choice = busy = None
    if choice is not None and busy is None:
        source = "cached"
    elif choice is not None and (now := others_load_now()) >= BUSY_CORES:
        source = (f"cached, timed while other processes kept {busy:g} cores busy; "
                  f"{now:.1f} still are")
    else:
        begin = time.perf_counter()
        chosen, load = others_load_while(lambda: measure_products(shape, products, dtype))
        choice = ProductChoice(chosen)
        source = f"measured in {time.perf_counter() - begin:.1f} s"
        entry = {"threads": threads, "shape": [k, n], "products": choice.by_bucket}
        if load >= BUSY_CORES:
            entry["busy"] = round(load, 1)
            source += (f" while other processes kept {load:.1f} cores busy, cached until a "
                       "quieter start times it again")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    logger.info("%s dense products of %d x %d on %d thread(s): %s (%s on this host: %s)",
                str(dtype).removeprefix("torch."), k, n, threads, choice.describe(), source, path)
    return choice
