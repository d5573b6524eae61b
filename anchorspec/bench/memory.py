"""Peak memory of one call.

CUDA: torch's peak allocated bytes (reset before the call). CPU (Linux): the process's resident-set
high-water mark (VmHWM), reset before the call through /proc/self/clear_refs ("5"). That figure
includes the loaded models and the allocator's cached pages, so it compares methods run in the same
process; it is not the method's own footprint. Elsewhere: None.
"""

from __future__ import annotations

from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _hwm_mib() -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class PeakMemory:
    def __init__(self):
        self.mib: float | None = None
        self._cuda = torch.cuda.is_available()
        self._rss_ok = False

    def __enter__(self):
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                _CLEAR.write_text("5")
                self._rss_ok = True
            except OSError:
                self._rss_ok = False
        return self

    def __exit__(self, *exc):
        if self._cuda:
            self.mib = torch.cuda.max_memory_allocated() / 2**20
        elif self._rss_ok:
            self.mib = _hwm_mib()
        return False
