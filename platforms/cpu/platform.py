"""The CPU platform: torch's cpu device, with dtype and memory choices read from the host, and
its own answers: the native-kernel attention backend and fused ops (when the kernels build), an
eager forward pass, gloo collectives and torch's native int8/int4 kernels."""
from __future__ import annotations

import logging
import os
import platform as pyplatform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.plugins.interfaces import (BackendCandidate, Communicator, CommunicatorSpec,
                                        EagerRunner, GraphRunner, ModelInfo, Platform)


if TYPE_CHECKING:
    from runtime.platforms.cpu.contention import ThreadShare

logger = logging.getLogger(__name__)

GiB = 1 << 30
# The KV cache gets this share of the memory available when the engine starts (the weights are
# already loaded by then, so they are not counted twice), capped so that a big host is not
# emptied by default; `--kv-cache-memory` overrides both.
KV_CACHE_SHARE = 0.4
KV_CACHE_CAP = 8 * GiB

# Features worth knowing for kernels and dtype choice (x86 "flags", ARM "Features").
X86_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")
ARM_FEATURES = ("asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # "x86_64", "aarch64" or what platform.machine() says
    model_name: str
    features: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """Whether the ISA has bf16 arithmetic (otherwise bf16 matmuls are emulated and slow)."""
        if self.arch == "x86_64":
            return bool(self.features & {"avx512_bf16", "amx_bf16"})
        return self.arch == "aarch64" and "bf16" in self.features


def normalize_arch(machine: str) -> str:
    machine = machine.lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """Read the model name and ISA features from /proc/cpuinfo text (first processor only)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key not in fields:
            fields[key] = value.strip()
    if arch == "x86_64":
        flags, known = fields.get("flags", ""), X86_FEATURES
    else:
        flags, known = fields.get("Features", ""), ARM_FEATURES
    model = fields.get("model name") or fields.get("Hardware") or fields.get("CPU part") or arch
    return CpuInfo(arch, model, frozenset(flags.split()) & frozenset(known))


def read_cpuinfo() -> CpuInfo:
    """This host's CpuInfo; without /proc/cpuinfo (macOS, Windows) the feature set is empty."""
    arch = normalize_arch(pyplatform.machine())
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    info = parse_cpuinfo(text, arch)
    if info.model_name == arch and pyplatform.processor():
        info = CpuInfo(arch, pyplatform.processor(), info.features)
    return info


def parse_meminfo_available(text: str) -> int | None:
    """MemAvailable in bytes from /proc/meminfo text, or None when absent."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def available_memory_bytes() -> int:
    """Memory this process can still take: MemAvailable, bounded by a cgroup (container) limit."""
    try:
        with open("/proc/meminfo") as f:
            available = parse_meminfo_available(f.read())
    except OSError:
        available = None
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup_free = _cgroup_free_bytes()
    return min(available, cgroup_free) if cgroup_free is not None else available


def _cgroup_free_bytes() -> int | None:
    # cgroup v2, then v1; "max" or a near-2**63 limit means no limit.
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(int(limit) - usage, 0)
    return None


def kv_cache_budget(requested: int | None, available: int) -> int:
    """The KV-cache byte budget: `requested` when given, else a share of `available`, capped."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"KV-cache memory must be positive, got {requested} bytes")
        if requested > available:
            raise ValueError(f"--kv-cache-memory-bytes asks for {requested / GiB:.2f} GiB but "
                             f"this host has {available / GiB:.2f} GiB of memory available; "
                             "ask for less, or leave it out for a safe share")
        return requested
    return min(int(available * KV_CACHE_SHARE), KV_CACHE_CAP)


class CpuPlatform(Platform):
    """Runs on torch's cpu device: bf16 by default only where the ISA computes it natively.

    A third-party platform that computes on the host gets these answers (the CPU kernels
    included) by subclassing this class; sharing `device_type` "cpu" gives it nothing.
    """

    name = "cpu"
    device_type = "cpu"

    def __init__(self, info: CpuInfo | None = None) -> None:
        self.info = info or read_cpuinfo()
        self.thread_share: ThreadShare | None = None  # set by set_threads under `auto`

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.info.native_bf16 else torch.float32

    def set_device(self, device: torch.device) -> None:
        """The host's memory is the device: the heap keeps the pages a step frees, for the
        next step's activations (`platforms/cpu/heap.py`)."""
        from runtime.platforms.cpu.heap import keep_freed_pages
        keep_freed_pages()

    def kv_cache_memory_bytes(self, requested: int | None, model_bytes: int) -> int:
        # The weights already sit in RAM, so MemAvailable has accounted for `model_bytes`.
        return kv_cache_budget(requested, available_memory_bytes())

    def empty_cache(self) -> None:
        """The heap keeps the pages tensors free (`set_device`): hand them back to the OS."""
        from runtime.platforms.cpu.heap import give_back_freed_pages
        give_back_freed_pages()

    def set_threads(self, num_threads: int | None, host_rank: int, host_ranks: int) -> None:
        """Bind the rank's OpenMP threads one per core, as `RUNTIME_CPU_OMP_THREADS_BIND` says
        (`platforms/cpu/threads.py`); with `nobind`, the usable cores shared out evenly."""
        from runtime.platforms.cpu import threads
        from runtime.platforms.cpu.contention import ThreadShare
        self.thread_share = None
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"thread count must be at least 1, got {num_threads}")
        nodes, usable, spec = threads.numa_nodes(), threads.usable_cpus(), threads.bind_spec()
        cpus = threads.plan_cpus(spec, host_rank, host_ranks, num_threads,
                                 threads.reserved_cpus(), nodes, usable)
        if cpus is None:
            torch.set_num_threads(num_threads or max(1, len(usable) // host_ranks))
            return
        count, pool = len(cpus), cpus
        if spec == "auto":
            pool = threads.plan_cpus(spec, host_rank, host_ranks, None, threads.reserved_cpus(),
                                     nodes, usable)
            load = threads.cpu_load(pool)
            cpus = threads.idlest(pool, load, count)  # fewer threads than cores: the free ones
            busy = threads.busy_cpus(cpus, load)
            if busy:
                count = max(1, len(cpus) - len(busy))
                logger.warning(
                    "rank %d: CPUs %s are busy with other processes (%s of the time): threads "
                    "pinned there would wait on them, so %d unpinned thread(s) run instead "
                    "(%s=%s pins anyway)", host_rank, busy,
                    ", ".join(f"{load[c]:.0%}" for c in busy), count, threads.BIND_ENV,
                    ",".join(map(str, cpus)))
        failed = self.kernel_build_error()
        if failed:
            logger.warning("threads not pinned one per core (the CPU kernels did not build: "
                           "%s); rank %d runs %d threads on CPUs %s", failed, host_rank,
                           count, cpus)
            torch.set_num_threads(count)
            return
        # The main thread (OpenMP thread 0) keeps the rank's whole share where ranks share the
        # host or the list was asked for. A lone rank under `auto` is often the user's own
        # Python process: its main thread stays free, or every process it starts later would
        # inherit the share.
        lone = host_ranks == 1 and spec == "auto"
        cpu_nodes = threads.nodes_of(cpus, nodes)
        share = ThreadShare(host_rank, cpus, pool, cpu_nodes, usable if lone else pool, count)
        self.thread_share = share if spec == "auto" else None  # a list asked for stays pinned
        if count == len(cpus):
            logger.info("rank %d: %d threads pinned to CPUs %s (NUMA nodes %s)", host_rank,
                        len(cpus), cpus, cpu_nodes)

    def rebalance_threads(self) -> None:
        """Under `auto`, drop the threads of cores other processes took while the rank ran,
        and pin them again once free (`platforms/cpu/contention.py`)."""
        if self.thread_share is not None:
            self.thread_share.check()

    def describe(self) -> dict[str, Any]:
        available = available_memory_bytes()
        return {
            "cpu": self.info.model_name,
            "arch": self.info.arch,
            "cores": os.cpu_count(),
            "usable cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "torch threads": torch.get_num_threads(),
            "features": " ".join(sorted(self.info.features)) or "none detected",
            "native bf16": self.info.native_bf16,
            "default dtype": str(self.default_dtype()).removeprefix("torch."),
            "memory available": f"{available / GiB:.1f} GiB",
            "default KV cache": f"{kv_cache_budget(None, available) / GiB:.1f} GiB",
        }

    def kernel_build_error(self) -> str | None:
        """Why the CPU kernels are not loaded (building them the first time), or None when
        they are."""
        from runtime.platforms.cpu import kernels
        return kernels.load(self.info.model_name)

    def attention_backend_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        """The native-kernel backend first (when this host can build its kernels), then the
        portable one, which runs everywhere; for an MLA model, the MLA pair."""
        from runtime.attention_backends.cpu_paged import CpuPagedAttention
        from runtime.attention_backends.torch_paged import TorchPagedAttention
        from runtime.platforms.common import offer_backend
        native = []
        if CpuPagedAttention.supports(model.head_size, model.dtype, model.kv_cache_dtype,
                                      model.sliding_window, "cpu")[0]:
            failed = self.kernel_build_error()
            native = [f"the CPU kernels did not build: {failed}"] if failed else []
        if model.attention_kind == "mla":
            return self._mla_candidates(model)
        return [
            offer_backend("cpu_paged", CpuPagedAttention, 10, model, "cpu", self.name, native),
            offer_backend("torch_paged", TorchPagedAttention, 0, model, "cpu", self.name, []),
        ]

    def _mla_candidates(self, model: ModelInfo) -> list[BackendCandidate]:
        """For multi-head latent attention: the native decode kernel, then the portable one."""
        from runtime.attention_backends.mla import TorchMLAAttention
        from runtime.attention_backends.mla_cpu import CpuMLAAttention
        from runtime.platforms.common import offer_backend
        failed = self.kernel_build_error()
        native = [f"the CPU kernels did not build: {failed}"] if failed else []
        return [offer_backend("cpu_mla", CpuMLAAttention, 10, model, "cpu", self.name, native),
                offer_backend("torch_mla", TorchMLAAttention, 0, model, "cpu", self.name, [])]

    def graph_runner(self, model: ModelInfo, enforce_eager: bool) -> GraphRunner:
        """Eager: compiling the glue between the fused ops bought nothing (docs/benchmarks.md)."""
        return EagerRunner()

    def communicator(self, spec: CommunicatorSpec) -> Communicator:
        """gloo collectives between host processes."""
        from runtime.platforms.cpu.communicator import GlooCommunicator
        return GlooCommunicator(spec)

    def quantization_kernel(self, method: str, params: dict[str, Any]) -> Any | None:
        """torch's native weight-only int8/int4 CPU kernels; None (the reference) for the rest."""
        from runtime.quantization.cpu import cpu_quantization_kernel
        return cpu_quantization_kernel(method, params)

    def custom_op(self, name: str) -> Callable | None:
        """Fused rms_norm, add_rms_norm, silu_and_mul and rotary_embedding from the CPU kernels,
        when they built, and dense layers through the fastest product measured per shape (the
        kernels' own `dense` among the candidates when they built)."""
        from runtime.platforms.cpu import ops
        if name == "linear":
            self.kernel_build_error()  # loads `dense` where it builds; torch's products need none
            return ops.linear
        if name not in ops.OPS:
            return None
        return ops.OPS[name] if self.kernel_build_error() is None else None

    def ray_resource(self) -> str:
        return "CPU"
