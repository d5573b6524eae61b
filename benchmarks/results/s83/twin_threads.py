"""Session 83: the target's narrow-step twin (inductor's C++ GEMM template) compiled by a 2-thread process against the
same graph compiled by a 1-thread process, each run at 2 and at 1 thread, one and four new rows after 128 cached
ones; graphs and sizes take turns within each repeat (medians of 9 after 2 warm-ups), float32.

    python benchmarks/results/s83/twin_threads.py TWIN_COMPILED_AT_2.pt2 TWIN_COMPILED_AT_1.pt2
"""
import statistics
import sys
import time

import torch
import torch._inductor

from anchorspec.api import load

target = load("smollm2-135m-instruct", threads=2).target  # eager: only the inputs' shapes are read from it
graphs = {"compiled at 2 threads": torch._inductor.aoti_load_package(sys.argv[1]),
          "compiled at 1 thread": torch._inductor.aoti_load_package(sys.argv[2])}
inputs = {n: target._aot_example(rows=1, tokens=n, past=128, kept=n, slots=1, capacity=128 + n) for n in (1, 4)}
with torch.no_grad():
    for threads in (2, 1):
        torch.set_num_threads(threads)
        times = {(name, n): [] for name in graphs for n in inputs}
        for r in range(11):
            for n, example in inputs.items():
                for name, graph in graphs.items():
                    t = time.perf_counter()
                    graph(*example)
                    if r >= 2:
                        times[name, n].append(time.perf_counter() - t)
        for (name, n), v in times.items():
            print(f"run at {threads} thread(s), {n} new row(s): twin {name}: {statistics.median(v) * 1e3:.1f} ms",
                  flush=True)
