"""Session 83: this host's memory bandwidth at 1 and 2 threads, on initialised data (a torch.empty tensor that was
never written reads the zero page and reports ~190 GB/s). Read: a sum over 128 MB; copy: bytes read + written.

    python benchmarks/results/s83/read_bandwidth.py
"""
import statistics
import time

import torch


def rate(fn, nbytes, reps=9):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[2:]) / 1e9


a = torch.randn(128 * 1024 * 1024 // 4)
b = torch.randn(a.numel())
for threads in (1, 2):
    torch.set_num_threads(threads)
    print(f"threads {threads}: copy (read + write) {rate(lambda: b.copy_(a), 2 * a.numel() * 4):.1f} GB/s, "
          f"read {rate(lambda: a.sum(), a.numel() * 4):.1f} GB/s", flush=True)
