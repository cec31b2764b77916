"""The shipped conformance suite, run for the cpu platform exactly as a plugin author runs it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_cpu_platform_passes_the_conformance_suite():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RUNTIME_PLUGINS", "RUNTIME_DEVICE")}
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.testing.conformance", "--device", "cpu", "-q",
         "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary
    # what the cpu platform does not implement is skipped with its reason, nothing else
    assert "SKIPPED" not in proc.stdout or all(
        "keeps the portable" in line or "quantization kernel" in line
        for line in proc.stdout.splitlines() if line.startswith("SKIPPED"))
