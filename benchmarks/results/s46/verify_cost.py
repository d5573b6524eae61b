"""The AOT-compiled target step's cost per new-token count T (batch 1, 200 keys behind it): one graph for
every T, timed directly (median of 15 calls after 3). Session 46, 2-core AMX Xeon, 2 threads.

    python benchmarks/results/s46/verify_cost.py [bfloat16|float32]"""
import time, statistics, torch, sys
torch.set_num_threads(2)
from anchorspec.models.target import load_target
dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
t = load_target("smollm2-135m-instruct", dt, pack="off")
t.compile()
g = t._aot_graph()
for T in (1, 2, 4, 8, 16, 32):
    args, mask, rows, cols, keys, values = t._aot_example(rows=1, tokens=T, past=200, kept=T, slots=1, capacity=400)
    with torch.inference_mode():
        for _ in range(3): g(args, mask, rows, cols, keys, values)
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); g(args, mask, rows, cols, keys, values); ts.append(time.perf_counter() - t0)
    print(f"T={T:3d}: {statistics.median(ts)*1e3:6.1f} ms", flush=True)
