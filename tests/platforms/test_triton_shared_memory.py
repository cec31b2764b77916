"""The Triton paged-attention kernel compiled for real GPU architectures on the CPU (no GPU:
tests/device/shared_memory.py), checked against each one's shared memory per block. A kernel
that asks for more fails at launch with OutOfResources."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

FITS = ["86:bfloat16:256:prefill"]  # sm86/sm89 at head size 256: the 64-row tile fits (68 KiB)
# Measured too big: the 64-row prefill tile with 32-position K/V tiles and Triton's default
# pipelining. Strict: fixing the kernel's tile choice turns these into failures to remove.
TOO_BIG = {"75:float16:256:prefill": "96 KiB on Turing (64 KiB)",
           "86:float32:256:prefill": "136.5 KiB on sm86/sm89 (99 KiB)"}


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "device", "shared_memory.py")
    out = subprocess.run([sys.executable, script, *FITS, *TOO_BIG, "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {f"{r['sm']}:{r['dtype']}:{r['head_size']}:{r['tile']}": r for r in rows}


@pytest.mark.parametrize("case", FITS + [
    pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=why))
    for case, why in TOO_BIG.items()])
def test_fits_in_shared_memory(measured, case):
    row = measured[case]
    assert row["fits"], f"{case}: {row['bytes']} > {row['limit']} bytes"
