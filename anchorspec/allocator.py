"""Process-wide allocator for CPU training: tcmalloc when it is installed, else glibc as it is.

A TTT step frees and re-allocates blocks of tens of MB every micro-batch (a [2048, 8192] fp32 logits
block is 67 MB). glibc serves blocks above 32 MB with fresh mmap pages and unmaps them on free, so
each such tensor pays its page faults again. Two fixes were measured on a 2-core EPYC (bf16, 1 thread,
micro-batches of eight different shapes as in a real run, `benchmarks/bench_ttt.py`):
- glibc told never to mmap and never to trim (`ANCHORSPEC_MALLOC=keep`): 1.2-1.4x faster, but with
  shapes that change every micro-batch the heap fragments without bound (two online training
  processes grew to 11.6 GB each within 250 steps and the machine thrashed, round 3 of the releases);
- tcmalloc (size-class free lists that keep freed spans for reuse): as fast, with a lower peak RSS
  than glibc's default. It is a Debian/Ubuntu package (`libtcmalloc-minimal4`) and must be loaded
  before the process allocates anything, so `train` re-executes itself with LD_PRELOAD once.
ANCHORSPEC_MALLOC: unset or `auto` (tcmalloc if found), `glibc` (leave the process as it is), `keep`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TCMALLOC_PATTERNS = ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc.so.4",
                     "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/local/lib/libtcmalloc_minimal.so*")
MODES = ("auto", "glibc", "keep")


def malloc_mode(environ=None) -> str:
    """ANCHORSPEC_MALLOC's value in `environ` (default: this process's), `auto` when unset or empty."""
    return (os.environ if environ is None else environ).get("ANCHORSPEC_MALLOC") or "auto"


def check_mode() -> str:
    """ANCHORSPEC_MALLOC's value, or a one-line error for an unknown one."""
    value = malloc_mode()
    if value not in MODES:
        from .errors import AnchorspecError

        raise AnchorspecError(f"ANCHORSPEC_MALLOC must be one of {', '.join(MODES)}, got {value!r}")
    return value


def find_tcmalloc() -> str | None:
    """The first tcmalloc shared library installed in a standard place, or None."""
    for pattern in TCMALLOC_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def active_allocator() -> str:
    """'tcmalloc', 'jemalloc' or 'glibc': which malloc this process runs on (from its mapped libraries)."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return "glibc"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in text:
            return name
    return "glibc"


def preload_command(cli_args: list[str], environ: dict) -> tuple[list[str], dict] | None:
    """The command and environment that re-run `python -m anchorspec CLI_ARGS` under tcmalloc, or None
    where that does not apply (another mode, not Linux, tcmalloc missing, already preloaded, or
    already re-run once)."""
    if malloc_mode(environ) != "auto" or not sys.platform.startswith("linux"):
        return None
    if environ.get("_ANCHORSPEC_PRELOADED") or "tcmalloc" in environ.get("LD_PRELOAD", ""):
        return None
    lib = find_tcmalloc()
    if lib is None:
        return None
    preload = " ".join(p for p in (lib, environ.get("LD_PRELOAD", "")) if p)
    command = [sys.executable, "-m", "anchorspec", *cli_args]
    return command, {**environ, "LD_PRELOAD": preload, "_ANCHORSPEC_PRELOADED": "1"}


def reexec_with_tcmalloc(cli_args: list[str]) -> None:
    """Replace this process with the same command under tcmalloc when `preload_command` says so
    (call it before any work: nothing done earlier survives). Returns only if it does not apply."""
    planned = preload_command(cli_args, dict(os.environ))
    if planned is not None:
        command, environ = planned
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(command[0], command, environ)


def keep_freed_memory() -> bool:
    """Apply the glibc setting when ANCHORSPEC_MALLOC=keep (glibc only). True if it took effect."""
    if malloc_mode() != "keep" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
