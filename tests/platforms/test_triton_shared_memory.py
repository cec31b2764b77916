"""The Triton paged-attention kernel compiled for real GPU architectures on the CPU (no GPU:
tests/device/shared_memory.py), checked against each one's shared memory per block. A kernel
that asks for more fails at launch with OutOfResources."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# The tiles the kernels pick from each target's limit, at the shapes whose preferred tile did
# not fit before the pick (Turing fp16 and sm86 fp32 at head 256: 96 and 136.5 KiB) or only just
# (sm86 bf16 at head 256), on MI300 (gfx942, 64 KiB of LDS) and for the decode tile in fp32.
FITS = ["86:bfloat16:256:prefill", "75:float16:256:prefill", "86:float32:256:prefill",
        "75:float32:256:decode", "gfx942:bfloat16:256:prefill", "gfx942:float32:128:prefill",
        "gfx942:float32:256:decode"]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "device", "shared_memory.py")
    out = subprocess.run([sys.executable, script, *FITS, "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {f"{r['sm']}:{r['dtype']}:{r['head_size']}:{r['tile']}": r for r in rows}


@pytest.mark.parametrize("case", FITS)
def test_fits_in_shared_memory(measured, case):
    row = measured[case]
    assert row["fits"], f"{case}: {row['bytes']} > {row['limit']} bytes"
