"""Shared memory the Triton paged-attention kernels need, per GPU architecture, with no GPU.

Triton compiles for a target without a device (ptxas ships with it, and its AMD backend links
in-process): a compile-only driver
stands in for the real one, every launch becomes a compile (`warmup`), and each compiled
kernel's `metadata.shared` is what the launch would ask for. A kernel that asks for more than
the architecture allows per block fails at launch with OutOfResources.

`python tests/device/shared_memory.py [ARCH:DTYPE:HEAD_SIZE:TILE ...] [--json]` prints the table
for the cases given (e.g. 86:float32:256:prefill for sm86, gfx942:bfloat16:256:prefill for
MI300), else for every case; TRITON_INTERPRET must not be set (the interpreter compiles
nothing). The kernels pick their tile from the limit the driver reports, as on the device.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

# Largest dynamic shared memory one block may use (CUDA's sharedMemPerBlockOptin; AMD's LDS per
# workgroup), in bytes, by CUDA compute capability or AMD architecture.
SHARED_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448, "gfx942": 65536}
PREFILL = ([1, 9], [5, 20])  # a prefill chunk in the batch: the prefill tile
DECODE = ([1, 1], [5, 20])  # decodes only: the decode tile
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CompileOnlyDriver:
    """What Triton's launcher asks the active driver, for a GPU that is not there."""

    def __init__(self, capability: int | str) -> None:
        from triton.backends.compiler import GPUTarget
        amd = isinstance(capability, str)
        self.target = GPUTarget("hip" if amd else "cuda", capability, 64 if amd else 32)
        # what the kernels' tile choice asks (an H100's multiprocessors: no decode splits here)
        self.utils = SimpleNamespace(get_device_properties=lambda index: {
            "max_shared_mem": SHARED_LIMIT[capability], "multiprocessor_count": 132})

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def attention_shared_memory(capability: int | str, dtype: str, head_size: int,
                            lens: tuple[list[int], list[int]]) -> int:
    """Bytes of shared memory the attention kernel asks for in one forward of the Triton
    backend (the K/V write kernel is not compiled). The compile-only driver stays active: this
    process launches nothing afterwards."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from runtime.attention_backends import triton_ops
    from runtime.attention_backends.triton_paged import TritonPagedAttention
    from runtime.testing.paged_batch import make_batch
    compiled: list[int] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ != "_paged_attention_kernel":
            return None
        self.device_caches.clear()  # compiled for another target before
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel.metadata.shared)
        return kernel

    driver.set_active(CompileOnlyDriver(capability))
    triton_ops.device_limits.cache_clear()  # asked of another target before
    JITFunction.run = compile_only
    try:
        query, key, value, kv_cache, metadata = make_batch(*lens, 16, 8, 2, head_size,
                                                           DTYPES[dtype])
        TritonPagedAttention(8, head_size, head_size ** -0.5, 2).forward(
            query, key, value, kv_cache, metadata)
    finally:
        JITFunction.run = launch
    return compiled[0]


def table(cases: list[tuple[int | str, str, int, str]]) -> list[dict]:
    """One row per (capability, dtype, head size, "prefill" | "decode")."""
    rows = []
    for capability, dtype, head_size, tile in cases:
        need = attention_shared_memory(capability, dtype, head_size,
                                       PREFILL if tile == "prefill" else DECODE)
        rows.append(dict(sm=capability, dtype=dtype, head_size=head_size, tile=tile, bytes=need,
                         limit=SHARED_LIMIT[capability], fits=need <= SHARED_LIMIT[capability]))
    return rows


def all_cases() -> list[tuple[int | str, str, int, str]]:
    return [(sm, dtype, head, tile) for sm in SHARED_LIMIT
            for dtype in ("float16", "bfloat16", "float32")
            if not (sm == 75 and dtype == "bfloat16")
            for head in (64, 128, 256) for tile in ("prefill", "decode")]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    cases = [(sm if sm.startswith("gfx") else int(sm), dtype, int(head), tile)
             for sm, dtype, head, tile in
             (a.split(":") for a in sys.argv[1:] if not a.startswith("--"))]
    rows = table(cases or all_cases())
    if "--json" in sys.argv:
        print(json.dumps(rows))
        return
    for r in rows:
        arch = r["sm"] if isinstance(r["sm"], str) else f"sm{r['sm']}"
        print(f"{arch:>6} {r['dtype']:>8} head {r['head_size']:>3} {r['tile']:>7}: "
              f"{r['bytes']:>7,} of {r['limit']:>7,} bytes{'' if r['fits'] else '  TOO BIG'}")


if __name__ == "__main__":
    main()
