"""tests/device/run.sh checked without a GPU: its section limits fit the budget of one 9-minute
call, each pytest process runs one file (each CUDA attention backend its own process), the bench
does not depend on the bandwidth check, and a section interrupted at its limit still reports
what its tests did."""
from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("run.sh")
TEXT = SCRIPT.read_text()
CUDA_BACKENDS = ("flash_attn", "flashinfer", "triton_paged", "torch_paged")


def sections() -> list[list[str]]:
    start = TEXT.index("SECTIONS=(\n")
    block = TEXT[start:TEXT.index("\n)\n", start)].splitlines()[1:]
    return [line.strip().strip('"').split("|") for line in block]


def test_section_limits_fit_the_budget():
    budget = int(re.search(r"RUN_BUDGET_S:-(\d+)", TEXT).group(1))
    assert sum(int(limit) for _, _, limit, _, _ in sections()) <= budget <= 540


def test_one_file_per_pytest_process_one_process_per_backend():
    commands = [command for *_, command in sections()]
    for command in commands:
        if command.startswith("$PYTEST"):
            assert len(re.findall(r"tests/\S+\.py", command)) == 1, command
    for name in CUDA_BACKENDS:
        assert sum(f"test_backend_matches and {name}'" in c for c in commands) == 1, name
    assert "bench" in commands and "python3 tests/device/decode_bandwidth.py" in commands
    assert "decode_bandwidth" not in TEXT[TEXT.index("bench() {"):]


def note(output: str, tmp_path: pathlib.Path) -> str:
    """What run.sh's `pytest_note` makes of a section's output."""
    out = tmp_path / "section.out"
    out.write_text(output)
    function = re.search(r"^pytest_note\(\) \{\n.*?^\}\n", TEXT, re.S | re.M).group(0)
    return subprocess.run(["bash", "-c", f'{function}\npytest_note "$1"', "_", str(out)],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_an_interrupted_pytest_still_reports(tmp_path):
    """SIGINT (what `timeout -s INT` sends at a section's limit) in the middle of a run."""
    (tmp_path / "test_cut.py").write_text(
        "import os, signal\n"
        "def test_one(): pass\n"
        "def test_two(): assert False\n"
        "def test_three(): os.kill(os.getpid(), signal.SIGINT)\n"
        "def test_never(): pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                          str(tmp_path / "test_cut.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120,
                         # a suite launched in the background inherits SIGINT ignored
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert run.returncode == 2  # interrupted
    assert note(run.stdout, tmp_path).startswith("1 failed, 1 passed")


def test_a_killed_pytest_reports_its_test_lines(tmp_path):
    """Killed outright (no summary line): the per-test lines are counted."""
    output = ("tests/x.py::test_a PASSED   [ 20%]\ntests/x.py::test_b[cuda] FAILED   [ 40%]\n"
              "tests/x.py::test_c PASSED   [ 60%]\ntests/x.py::test_d SKIPPED (no GPU) [ 80%]\n")
    assert note(output, tmp_path) == "2 passed 1 failed 1 skipped (before it stopped)"
