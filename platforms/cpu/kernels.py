"""The CPU platform's native kernels: C++ built on this host at first use, then cached.

The sources in `csrc/` are compiled with torch's extension tooling for the host's own ISA
(`-march=native`) into a library of torch ops under `torch.ops.runtime_cpu`. Each build lives in
its own folder named by a content key (sources, compiler flags, CPU model, torch version, Python
ABI), so virtual environments on one host never rebuild each other's library; a file lock makes
the first build happen once even when several processes start together, and the library is
published by an atomic rename, so a reader sees a complete file or none. A host without a C++
compiler (or ninja) keeps running: `load()` reports why, and the platform picks the portable
kernels instead.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from runtime.plugins import paths

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "threads.cpp",
           CSRC / "lora.cpp", CSRC / "encoder_ops.cpp", CSRC / "recurrent_ops.cpp",
           CSRC / "mla_attention.cpp", CSRC / "dense.cpp"]
HEADERS = [CSRC / "simd.h"]
LIBRARY = "runtime_cpu_kernels"
# The host's own ISA; on x86 GCC would otherwise keep znver/AVX2 code at 128-bit vectors.
X86 = platform.machine() in ("x86_64", "AMD64")
# -fopenmp: at::parallel_for is a `#pragma omp parallel` in ATen's headers, so without it every
# kernel runs on one thread. The library then needs libgomp.so.1, which resolves to the copy
# torch has already loaded: one OpenMP runtime, one thread pool, torch's thread count.
CFLAGS = (["-O3", "-march=native", "-mprefer-vector-width=256"] if X86
          else ["-O3", "-mcpu=native"]) + ["-fopenmp"]
LDFLAGS = ["-fopenmp"]
DISABLE_ENV = "RUNTIME_CPU_KERNELS"  # "0" turns the native kernels off


def cache_root() -> Path:
    return paths.cache_dir("cpu_kernels")


def content_key(files: list[Path], cflags: list[str], cpu_model: str) -> str:
    """What the built library depends on: the sources, the flags (and the CPU `-march=native`
    resolves to), torch's version and the Python ABI."""
    key = hashlib.sha256()
    for path in files:
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    abi = f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}"
    for part in (" ".join(cflags), cpu_model, torch.__version__, abi):
        key.update(b"\0" + part.encode())
    return key.hexdigest()[:20]


def cache_dir(cpu_model: str) -> Path:
    """Where this host's build lives: <cache root>/cpu_kernels/<content key> (the root:
    `runtime.plugins.paths`)."""
    return cache_root() / content_key(SOURCES + HEADERS, CFLAGS, cpu_model)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created if missing), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(folder: Path, name: str, sources: list[Path],
               cflags: list[str]) -> tuple[Path, bool]:
    """The library `folder/<name>.so`, built first if absent; returns it and whether this call
    built it. The build runs under a lock beside the folder, in `folder/build`, and the library
    appears only once complete. Loading it is the caller's job."""
    library = folder / f"{name}.so"
    with file_lock(folder.with_name(folder.name + ".lock")):
        if library.exists():
            return library, False
        from torch.utils.cpp_extension import load as build_and_load
        staging = folder / "build"
        staging.mkdir(parents=True, exist_ok=True)
        logger.info("building the CPU kernels into %s (once per host, about a minute)", folder)
        build_and_load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                       extra_ldflags=LDFLAGS, build_directory=str(staging),
                       is_python_module=False, verbose=False)
        os.replace(staging / f"{name}.so", library)
        return library, True


def loaded() -> bool:
    return hasattr(torch.ops.runtime_cpu, "paged_attention_decode")


@lru_cache(maxsize=1)
def load(cpu_model: str) -> str | None:
    """Build (first time for this content key) and load the kernels. Returns None when they
    are loaded, else the reason they are not."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    if loaded():  # a second library registering the same ops would abort the process
        return None
    try:
        library, _ = build_once(cache_dir(cpu_model), LIBRARY, SOURCES, CFLAGS)
        if not loaded():  # building loads the library it built
            torch.ops.load_library(str(library))
    except (RuntimeError, OSError, ImportError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.warning("CPU kernels unavailable, using the portable ones: %s", reason)
        return reason
    return None
