"""Thread binding on the CPU (`platforms/cpu/threads.py`, the `bind_threads` kernel): the plan
for each rank from vLLM's `..._OMP_THREADS_BIND` syntax, and a real binding in a fresh process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import EngineConfig
from runtime.distributed.layout import host_share
from runtime.platforms.cpu.threads import (auto_cpus, busy_cpus, cpu_load, cpu_times,
                                           load_between, niced_load_yields, nodes_of,
                                           parse_cpu_list, plan_cpus)


def fake_sysfs(tmp_path: Path, cores: int) -> Path:
    """Two SMT threads per core: CPU c and c + cores are siblings (Linux's usual numbering)."""
    for core in range(cores):
        for cpu in (core, core + cores):
            topology = tmp_path / f"cpu{cpu}" / "topology"
            topology.mkdir(parents=True)
            (topology / "thread_siblings_list").write_text(f"{core},{core + cores}\n")
    return tmp_path


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5\n") == [5]
    for bad in ("a-b", "3-1", "1-"):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpu_list(bad)


def test_auto_takes_one_node_per_rank_and_one_cpu_per_core(tmp_path):
    sysfs = fake_sysfs(tmp_path, cores=8)  # CPUs 0-15: nodes 0-3 + 8-11 and 4-7 + 12-15
    nodes = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    usable = list(range(16))
    # one logical CPU per physical core: the last sibling
    assert auto_cpus(0, 1, nodes, usable, sysfs) == [8, 9, 10, 11]
    assert auto_cpus(1, 2, nodes, usable, sysfs) == [12, 13, 14, 15]
    # more ranks than nodes: the cores split evenly, in node order
    assert [auto_cpus(r, 3, nodes, usable, sysfs) for r in range(3)] == [
        [8, 9, 10], [11, 12, 13], [14, 15]]
    # a cgroup or taskset leaving part of a node
    assert auto_cpus(0, 1, nodes, [0, 1, 9], sysfs) == [0, 9]
    # more ranks than cores: no binding, the ranks share them (as before binding existed)
    assert auto_cpus(0, 9, nodes, usable, sysfs) is None


def test_plan_lists_reserved_and_thread_count(tmp_path):
    sysfs = fake_sysfs(tmp_path, cores=4)
    nodes, usable = [list(range(8))], list(range(8))
    plan = lambda spec, rank=0, ranks=1, threads=None, reserved=0: plan_cpus(  # noqa: E731
        spec, rank, ranks, threads, reserved, nodes, usable, sysfs)
    assert plan("nobind") is None and plan("all") is None
    assert plan("0-1|2-3", rank=1, ranks=2) == [2, 3]
    assert plan("auto") == [4, 5, 6, 7]
    assert plan("auto", reserved=1) == [4, 5, 6]
    assert plan("auto", threads=2) == [4, 5]
    with pytest.raises(ValueError, match="gives 2 CPU lists for 3 ranks"):
        plan("0-1|2-3", ranks=3)
    with pytest.raises(ValueError, match=r"CPUs \[8\] are not usable"):
        plan("7-8")
    assert plan("auto", threads=5) is None  # more than the share's cores: unbound, as asked
    with pytest.raises(ValueError, match="more than the 2 cores"):
        plan("0-1", threads=3)
    with pytest.raises(ValueError, match="leaves no core"):
        plan("0-1", reserved=2)
    assert nodes_of([4, 5], [[0, 1, 2, 3], [4, 5, 6, 7]]) == [1]


def test_data_parallel_replicas_take_successive_shares():
    config = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_rank=1,
                          data_parallel_size_local=2)
    assert host_share(config, 1, 2) == (3, 4)


BIND = """
import json, os, torch
from runtime.platforms.cpu import threads
from runtime.platforms.cpu.platform import CpuPlatform
platform = CpuPlatform()
assert platform.kernel_build_error() is None
def allowed(tids):
    return [open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0]
            for t in tids]
tids = torch.ops.runtime_cpu.bind_threads([0, 1], [0])
result = {"tids": tids, "allowed": allowed(tids),
          "released": allowed(torch.ops.runtime_cpu.release_threads([0, 1], 2))}
os.environ["RUNTIME_CPU_OMP_THREADS_BIND"] = "1"
platform.set_threads(None, 0, 1)
result["one"] = [torch.get_num_threads(), sorted(os.sched_getaffinity(0))]
os.environ["RUNTIME_CPU_OMP_THREADS_BIND"] = "auto"
threads.cpu_load = lambda cpus, interval=0.2: {}  # an idle host, whatever runs beside the test
platform.set_threads(None, 0, 1)
result["auto"] = [torch.get_num_threads(), sorted(os.sched_getaffinity(0))]
threads.cpu_load = lambda cpus, interval=0.2: {cpus[0]: 0.9}  # another process holds one core
before = sorted(os.sched_getaffinity(0))
platform.set_threads(None, 0, 1)
result["busy"] = [torch.get_num_threads(), sorted(os.sched_getaffinity(0)) == before]
print(json.dumps(result))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_bind_threads_pins_each_openmp_thread():
    out = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert len(set(result["tids"])) == 2  # one pool thread per CPU
    assert result["allowed"] == ["0", "1"]
    assert result["released"] == ["0-1", "0-1"]  # release_threads unpins the pool
    # an explicit list: one thread, the main thread on CPU 1
    assert result["one"] == [1, [1]]
    # a second engine in the same process starts from every usable CPU again
    assert result["auto"][0] >= 2 and {0, 1} <= set(result["auto"][1])
    # a core another process keeps busy is not bound to: one thread fewer, none pinned
    assert result["busy"] == [result["auto"][0] - 1, True]


def test_cpu_load_reads_each_cores_busy_share():
    # user nice system idle iowait irq softirq steal
    before = cpu_times("cpu  10 0 10 80 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0\n")
    after = cpu_times("cpu  110 0 10 180 0 0 0 0\ncpu0 95 0 5 50 0 0 0 0\n"
                      "cpu1 15 0 5 130 0 0 0 0\n")
    load = load_between(before, after, [0, 1, 7])
    assert load == pytest.approx({0: 0.9, 1: 0.1})
    assert busy_cpus([0, 1, 7], load) == [0]
    assert set(cpu_load([0])) <= {0}  # the real /proc/stat reads, or nothing where there is none


def test_niced_load_is_idle_unless_counted():
    # cpu0 spends 80 of 100 jiffies in niced processes (the second column)
    before = cpu_times("cpu0 0 0 0 100 0 0 0 0\n", count_niced=False)
    after = cpu_times("cpu0 10 80 0 110 0 0 0 0\n", count_niced=False)
    assert load_between(before, after, [0]) == pytest.approx({0: 0.1})
    before = cpu_times("cpu0 0 0 0 100 0 0 0 0\n")
    after = cpu_times("cpu0 10 80 0 110 0 0 0 0\n")
    assert load_between(before, after, [0]) == pytest.approx({0: 0.9})


def test_niced_load_yields_only_without_autogroup(tmp_path):
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")  # each session gets an equal share whatever its nice
    assert not niced_load_yields(flag)
    flag.write_text("0\n")
    assert niced_load_yields(flag) == (os.getpriority(os.PRIO_PROCESS, 0) <= 0)
    assert niced_load_yields(tmp_path / "absent") == (os.getpriority(os.PRIO_PROCESS, 0) <= 0)
