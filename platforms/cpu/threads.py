"""Which cores each rank's threads run on, as vLLM's CPU worker binds them.

`RUNTIME_CPU_OMP_THREADS_BIND` (vLLM's `VLLM_CPU_OMP_THREADS_BIND` is read when ours is unset)
takes vLLM's values:

- `auto` (default): each rank on this host gets the cores of one NUMA node, one logical CPU per
  physical core (SMT siblings would share one core's vector units); with more ranks than nodes,
  the cores are split evenly between the ranks, node by node; with more ranks than cores, no
  binding (the ranks share the cores, `usable cores // ranks` threads each, at least 1).
- a list per rank, `0-31|32-63`: rank i takes the i-th list (`0-3,8,10-11` syntax).
- `nobind` (or `all`): no binding; threads as torch starts them.

`RUNTIME_CPU_NUM_OF_RESERVED_CPU` leaves the last N cores of each rank's share free for the
front end (tokenizer, server). `--num-threads` takes the first N cores of the share; under
`auto`, more threads than the share has cores run unbound.

Under `auto`, cores that other processes keep busy when the rank starts are not bound to: an
OpenMP thread pinned to a core it shares spins at every barrier while the other process holds
the core, and each step waits for the slowest thread (measured on a 2-core host beside a busy
test suite: 7 output tok/s with two pinned threads, 38 with one unpinned). The rank then runs
one unpinned thread per idle core of its share, at least one. The time of niced processes
counts as idle when they give way to the rank (it is not niced, and autogroup scheduling is off).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

BIND_ENV = "RUNTIME_CPU_OMP_THREADS_BIND"
VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "RUNTIME_CPU_NUM_OF_RESERVED_CPU"
SYS_CPU = Path("/sys/devices/system/cpu")
PROC_STAT = Path("/proc/stat")
BUSY_SHARE = 0.5  # a core that others use at least this share of the time is busy
SYS_NODE = Path("/sys/devices/system/node")
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` → [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist syntax)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges such as 0-3,8")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"bad CPU range {part!r} in {text!r}: the end is below the start")
        cpus.extend(range(lo, hi + 1))
    return cpus


def affinity() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


# Taken when the first engine of this process binds (the module is imported then), before
# binding narrows the main thread: a later engine in the same process starts from all of them.
USABLE = affinity()


def usable_cpus() -> list[int]:
    """The CPUs this process could run on before any binding."""
    return list(USABLE)


def numa_nodes(sys_node: Path = SYS_NODE) -> list[list[int]]:
    """Each NUMA node's CPUs (one node holding every CPU where sysfs does not say)."""
    nodes = []
    for folder in sorted(sys_node.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = parse_cpu_list((folder / "cpulist").read_text())
        if cpus:
            nodes.append(cpus)
    return nodes or [list(range(os.cpu_count() or 1))]


def one_per_core(cpus: list[int], sys_cpu: Path = SYS_CPU) -> list[int]:
    """One logical CPU per physical core among `cpus` (the last sibling, as vLLM keeps)."""
    kept: dict[str, int] = {}
    for cpu in cpus:
        siblings = sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        core = siblings.read_text().strip() if siblings.exists() else str(cpu)
        kept[core] = cpu
    return sorted(kept.values())


def auto_cpus(local_rank: int, local_ranks: int, nodes: list[list[int]],
              usable: list[int], sys_cpu: Path = SYS_CPU) -> list[int] | None:
    """`auto`: the cores of node `local_rank`, or an even split when ranks outnumber nodes;
    None (no binding: the ranks share the cores) when they outnumber the cores too."""
    allowed = set(usable)
    per_node = [one_per_core([c for c in cpus if c in allowed], sys_cpu) for cpus in nodes]
    per_node = [cpus for cpus in per_node if cpus]
    if local_ranks <= len(per_node):
        return per_node[local_rank]
    cores = [cpu for cpus in per_node for cpu in cpus]
    if local_ranks > len(cores):
        return None
    base, extra = divmod(len(cores), local_ranks)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (local_rank < extra)]


def plan_cpus(spec: str, local_rank: int, local_ranks: int, num_threads: int | None,
              reserved: int, nodes: list[list[int]], usable: list[int],
              sys_cpu: Path = SYS_CPU) -> list[int] | None:
    """The CPUs rank `local_rank` binds its threads to, or None for no binding."""
    spec = spec.strip()
    if spec in ("nobind", "all"):
        return None
    if spec == "auto":
        cpus = auto_cpus(local_rank, local_ranks, nodes, usable, sys_cpu)
        if cpus is None:
            return None
    else:
        lists = spec.split("|")
        if len(lists) != local_ranks:
            raise ValueError(f"{BIND_ENV}={spec!r} gives {len(lists)} CPU lists for "
                             f"{local_ranks} ranks on this host; give one per rank, split by |")
        cpus = parse_cpu_list(lists[local_rank])
        outside = sorted(set(cpus) - set(usable))
        if outside:
            raise ValueError(f"{BIND_ENV}: CPUs {outside} are not usable by this process "
                             f"(usable: {usable})")
    if reserved:
        if reserved >= len(cpus):
            raise ValueError(f"{RESERVED_ENV}={reserved} leaves no core of {cpus} for the model")
        cpus = cpus[:-reserved]
    if num_threads is not None:
        if num_threads > len(cpus):
            if spec == "auto":  # more threads than the share has cores (SMT siblings, say)
                return None
            raise ValueError(f"--num-threads {num_threads} is more than the {len(cpus)} cores "
                             f"bound to this rank ({cpus}); set {BIND_ENV}=nobind to "
                             f"oversubscribe")
        cpus = cpus[:num_threads]
    return cpus


def nodes_of(cpus: list[int], nodes: list[list[int]]) -> list[int]:
    """The NUMA nodes holding `cpus` (their memory is the local memory of those cores)."""
    return [index for index, node in enumerate(nodes) if set(node) & set(cpus)]


def bind_spec() -> str:
    """The binding asked for; `nobind` where the OS has no thread affinity (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return "nobind"
    return os.environ.get(BIND_ENV) or os.environ.get(VLLM_BIND_ENV) or "auto"


def reserved_cpus() -> int:
    text = os.environ.get(RESERVED_ENV, "0")
    if not text.isdigit():
        raise ValueError(f"{RESERVED_ENV}={text!r}: expected a whole number of cores")
    return int(text)


def cpu_times(stat_text: str, count_niced: bool = True) -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each CPU in /proc/stat's text (idle and iowait are idle; so is
    the time of niced processes, the `nice` column, unless `count_niced`)."""
    times = {}
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in fields[:8]]
            idle = values[3] + values[4] + (0 if count_niced else values[1])
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def niced_load_yields(autogroup: Path = AUTOGROUP) -> bool:
    """Whether processes running niced (nice > 0) give way to this one: when this one is not
    niced itself and the kernel weighs nice across the whole host, not per session (autogroup
    scheduling off; with it on, each session gets an equal share whatever its nice). Then a
    nice-0 thread gets ~98 % of a core shared with a nice-19 one, so a core busy only with niced
    work is as good as idle for pinned threads."""
    if not hasattr(os, "getpriority") or os.getpriority(os.PRIO_PROCESS, 0) > 0:
        return False
    try:
        return autogroup.read_text().strip() == "0"
    except OSError:  # no autogroup scheduling in this kernel
        return True


def cpu_load(cpus: list[int], interval: float = 0.2, stat: Path = PROC_STAT) -> dict[int, float]:
    """The share of `interval` seconds each of `cpus` spent running something that would not
    give way to this process (the caller is idle meanwhile, so it is other processes' load);
    empty where /proc/stat is unreadable."""
    count_niced = not niced_load_yields()
    try:
        before = cpu_times(stat.read_text(), count_niced)
        time.sleep(interval)
        after = cpu_times(stat.read_text(), count_niced)
    except OSError:
        return {}
    return load_between(before, after, cpus)


def load_between(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
                 cpus: list[int]) -> dict[int, float]:
    """Each of `cpus`' busy share between two `cpu_times` samples."""
    load = {}
    for cpu in cpus:
        if cpu in before and cpu in after:
            busy, total = (a - b for a, b in zip(after[cpu], before[cpu]))
            load[cpu] = busy / total if total > 0 else 0.0
    return load


def busy_cpus(cpus: list[int], load: dict[int, float]) -> list[int]:
    return [cpu for cpu in cpus if load.get(cpu, 0.0) >= BUSY_SHARE]


def idlest(cpus: list[int], load: dict[int, float], count: int) -> list[int]:
    """`count` of `cpus`, those not busy first (two engines of one thread each on a host then
    take different cores), in CPU order."""
    busy = set(busy_cpus(cpus, load))
    return sorted(sorted(cpus, key=lambda cpu: cpu in busy)[:count])
