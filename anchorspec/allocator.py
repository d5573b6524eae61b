"""Process-wide allocator setting for CPU training.

glibc serves allocations above 32 MB (a [2048, 8192] fp32 logits block is 67 MB) with fresh mmap
pages and unmaps them on free, so every such tensor pays its page faults again: on a 2-core EPYC a
TTT step spent more time faulting than in its loss (8.8 s against 11.5 s per 2048-token batch with
the setting below, measured by a profile of `ttt_forward`). Telling glibc never to mmap and never to
trim keeps freed blocks in the heap for the next step. The process's resident size then stays at its
peak, which a training run reaches in its first step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Apply the setting (glibc only; ANCHORSPEC_MALLOC=default opts out). True if it took effect."""
    if os.environ.get("ANCHORSPEC_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
