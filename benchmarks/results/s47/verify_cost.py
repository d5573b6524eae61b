"""The AOT-compiled target step's cost per new-token count T (batch 1, 200 keys behind it): one graph for
every T, timed directly (median of 15 calls after 3). Session 46's script, on the current API (session 47).

    python benchmarks/results/s47/verify_cost.py [bfloat16|float32]"""
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from anchorspec.models.target import load_target  # noqa: E402

dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
t = load_target("smollm2-135m-instruct", dt, pack="off")
t.compile()
graph = t.load_graph()
for T in (1, 2, 3, 4, 5, 6, 8, 16, 32):
    example = t._aot_example(rows=1, tokens=T, past=200, kept=T, slots=1, capacity=400)
    with torch.inference_mode():
        for _ in range(3):
            graph(*example)
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            graph(*example)
            ts.append(time.perf_counter() - t0)
    print(f"T={T:3d}: {statistics.median(ts) * 1e3:6.1f} ms", flush=True)
