"""The CPU platform's native kernels: C++ built on this host at first use, then cached.

The sources in `csrc/` are compiled with torch's extension tooling for the host's own ISA
(`-march=native`), into a cache folder keyed by the torch version, the compiler flags, the
sources and the CPU, and loaded as a library of torch ops under `torch.ops.runtime_cpu`. A host
without a C++ compiler (or ninja) keeps running: `load()` reports why, and the platform picks the
portable kernels instead.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp"]
HEADERS = [CSRC / "simd.h"]
# The host's own ISA; on x86 GCC would otherwise keep znver/AVX2 code at 128-bit vectors.
X86 = platform.machine() in ("x86_64", "AMD64")
CFLAGS = (["-O3", "-march=native", "-mprefer-vector-width=256"] if X86
          else ["-O3", "-mcpu=native"]) + ["-fopenmp-simd"]
DISABLE_ENV = "RUNTIME_CPU_KERNELS"  # "0" turns the native kernels off


def cache_dir(cpu_model: str) -> Path:
    """Where this host's build lives: ~/.cache/runtime/cpu_kernels/<torch>-<key>."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    key.update(" ".join(CFLAGS).encode())
    key.update(cpu_model.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runtime"
    return root / "cpu_kernels" / f"torch{torch.__version__}-{key.hexdigest()[:16]}"


def loaded() -> bool:
    return hasattr(torch.ops.runtime_cpu, "paged_attention_decode")


@lru_cache(maxsize=1)
def load(cpu_model: str) -> str | None:
    """Build (first time on this host) and load the kernels. Returns None when they are
    loaded, else the reason they are not."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    if loaded():  # a second library registering the same ops would abort the process
        return None
    from torch.utils.cpp_extension import load as build_and_load
    build_dir = cache_dir(cpu_model)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("building the CPU kernels into %s (once per host, about a minute)", build_dir)
    try:
        build_and_load(name="runtime_cpu_kernels", sources=[str(s) for s in SOURCES],
                       extra_cflags=CFLAGS, build_directory=str(build_dir),
                       is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.warning("CPU kernels unavailable, using the portable ones: %s", reason)
        return reason
    return None
