"""The CPU kernel cache: one build per content key, under a lock, reused afterwards."""
import subprocess
import sys
import textwrap

from runtime.platforms.cpu import kernels

OP_SOURCE = """
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.add(x); }
TORCH_LIBRARY(runtime_cache_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""

# Builds (or reuses) the library, loads it, runs its op; prints whether this process built it.
CLIENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from runtime.platforms.cpu.kernels import build_once
    folder, source = Path(sys.argv[1]), Path(sys.argv[2])
    library, built = build_once(folder, "cache_test_ops", [source], ["-O0"])
    if not built:
        torch.ops.load_library(str(library))
    assert torch.equal(torch.ops.runtime_cache_test.twice(torch.ones(3)), torch.full((3,), 2.0))
    print("built" if built else "reused")
""")


def _start(folder, source):
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(folder), str(source)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_concurrent_first_builds_build_once_and_both_load(tmp_path):
    source = tmp_path / "ops.cpp"
    source.write_text(OP_SOURCE)
    folder = tmp_path / "cache" / kernels.content_key([source], ["-O0"], "test-cpu")
    procs = [_start(folder, source) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert sorted(out.strip() for out, _ in results) == ["built", "reused"]
    assert [f.name for f in folder.glob("*.so")] == ["cache_test_ops.so"]
    again = _start(folder, source)  # a later process only loads the library
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and out.strip() == "reused", err[-3000:]


def test_the_content_key_follows_sources_flags_and_cpu(tmp_path):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int a;")
    b.write_text("int b;")
    key = kernels.content_key([a], ["-O3"], "cpu1")
    assert key == kernels.content_key([a], ["-O3"], "cpu1")
    assert len({key, kernels.content_key([b], ["-O3"], "cpu1"),
                kernels.content_key([a], ["-O2"], "cpu1"),
                kernels.content_key([a], ["-O3"], "cpu2")}) == 4
    assert kernels.cache_dir("cpu1").parent == kernels.cache_root()
