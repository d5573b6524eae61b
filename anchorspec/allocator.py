"""Process-wide allocator setting for CPU training, opt-in (ANCHORSPEC_MALLOC=keep).

glibc serves allocations above 32 MB (a [2048, 8192] fp32 logits block is 67 MB) with fresh mmap
pages and unmaps them on free, so every such tensor pays its page faults again: on a 2-core EPYC a
TTT step on fixed shapes ran 1.41x faster with glibc told never to mmap and never to trim
(`benchmarks/bench_ttt.py`: 4.8 against 6.8 s per 2048-token micro-batch). But in a real run, where
every micro-batch has another shape, the heap fragmented without bound: two online training
processes grew to 11.6 GB each within 250 steps and the machine thrashed (measured, round 3 of the
released drafters). So it is off unless asked for, for runs whose shapes repeat.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Apply the setting when ANCHORSPEC_MALLOC=keep (glibc only). True if it took effect."""
    if os.environ.get("ANCHORSPEC_MALLOC") != "keep" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
