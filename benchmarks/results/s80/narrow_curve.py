"""The target's (and drafter's) two AOT step graphs, timed on one row of N new tokens after 128 cached
ones, N up to 64: where the C++ GEMM template's graph (narrow) stops beating oneDNN's (wide). Session 80.

    python benchmarks/results/s80/narrow_curve.py [--threads 2] [--sizes 1,2,4,...]"""
import argparse, json, platform, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from anchorspec.models.compiled import NarrowWide  # noqa: E402
from anchorspec.models.target import load_target  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--sizes", default="1,2,4,8,12,16,20,24,32,40,48,64")
ap.add_argument("--repeats", type=int, default=9)
args = ap.parse_args()
torch.set_num_threads(args.threads)
t = load_target("smollm2-135m-instruct", getattr(torch, args.dtype), pack="off")
t.compile()
g = t.load_graph()
assert isinstance(g, NarrowWide), g
sizes = [int(s) for s in args.sizes.split(",")]
inputs = {n: t._aot_example(rows=1, tokens=n, past=128, kept=n, slots=1, capacity=128 + n) for n in sizes}
times = {k: {n: [] for n in sizes} for k in ("narrow", "wide")}
with torch.inference_mode():
    for r in range(args.repeats + 2):
        for n in sizes:
            for k, graph in (("narrow", g.narrow), ("wide", g.wide)):
                s = time.perf_counter(); graph(*inputs[n]); e = time.perf_counter() - s
                if r >= 2:
                    times[k][n].append(e)
out = {"dtype": args.dtype, "threads": args.threads, "cpu": platform.processor(), "verdict_up_to": g.up_to,
       "ms": {k: {n: round(min(v) * 1e3, 2) for n, v in by.items()} for k, by in times.items()},
       "median_ms": {k: {n: round(sorted(v)[len(v) // 2] * 1e3, 2) for n, v in by.items()} for k, by in times.items()}}
for n in sizes:
    print(f"{n:3d} rows: narrow {out['ms']['narrow'][n]:7.2f} ms  wide {out['ms']['wide'][n]:7.2f} ms  "
          f"ratio {out['ms']['wide'][n] / out['ms']['narrow'][n]:.2f}")
print(json.dumps(out))
