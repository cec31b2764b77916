"""glibc's malloc tuned for a step loop that frees and reallocates the same multi-MB activations.

By default glibc serves blocks above its mmap threshold (128 KiB, rising as large blocks are
freed) from fresh mappings, and gives the top of the heap back to the kernel once more than its
trim threshold lies free there. Either way, the next step's activations fault in zeroed pages
again, which on a 2-core host cost several percent of a step (a Granite 4.0-H-style prefill of
2048 tokens: its float32 norm temporaries ran at a third of their later speed). Raising both
keeps the freed pages in the heap for the next step; `malloc_trim` (the platform's
`empty_cache`, for sleep mode and weight reloads) still hands them back on purpose.
"""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit hosts
TRIM_THRESHOLD = 1 << 30
# what the user may have set (GLIBC_TUNABLES entry, the older environment variable), per knob
USER_SETTINGS = {M_MMAP_THRESHOLD: ("glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
                 M_TRIM_THRESHOLD: ("glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_")}


def user_set(param: int, environ: dict[str, str]) -> bool:
    """Whether the environment already sets this malloc knob."""
    tunable, variable = USER_SETTINGS[param]
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    return variable in environ or any(t.startswith(tunable + "=") for t in tunables)


def glibc() -> ctypes.CDLL | None:
    """This process's glibc, None under another libc (musl's own malloc is left alone)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_pages() -> dict[str, int]:
    """Raise glibc's mmap and trim thresholds in this process, except a knob the environment
    sets itself. Returns the knobs set ({} where libc is not glibc)."""
    libc = glibc()
    if libc is None:
        return {}
    chosen = {}
    for name, param, value in (("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if not user_set(param, os.environ) and libc.mallopt(param, value) == 1:
            chosen[name] = value
    if chosen:
        logger.info("glibc malloc keeps freed pages: %s",
                    ", ".join(f"{k}={v}" for k, v in chosen.items()))
    return chosen


def give_back_freed_pages() -> None:
    """Hand the heap's free pages back to the kernel now (`malloc_trim`), whatever the trim
    threshold keeps."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
