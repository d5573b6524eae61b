"""Where a plain step's time goes, eager or compiled (`--compile`: load(compile=True), inductor with frozen
weights): torch.profiler over one 128-token greedy generation of MT-bench's first prompt after a warm-up,
self CPU time per op per generated token, against the same generation timed without the profiler.

    python benchmarks/results/s45/step_profile.py [--compile] [--threads 2]"""
import argparse, sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--compile", action="store_true")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--top", type=int, default=25)
a = ap.parse_args()
t0 = time.perf_counter()
e = load("smollm2-135m-instruct", dtype="auto", threads=a.threads, compile=a.compile)
print(f"load: {time.perf_counter() - t0:.0f} s")
ids = e.encode(load_prompts(DEFAULT_DATA, 1)[0]["text"], chat=True)
e.generate(ids, max_new_tokens=128, speculative=False)  # warm-up
best = 1e9
for _ in range(3):
    t0 = time.perf_counter()
    n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
    best = min(best, (time.perf_counter() - t0) / n)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
print(f"{e.target.dtype}, compile {a.compile}, {a.threads} threads: best of 3 {best * 1e3:.1f} ms a token "
      f"unprofiled ({1 / best:.1f} tok/s), {n} tokens")
rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)
total = sum(r.self_cpu_time_total for r in rows)
print(f"profiled: {total / n / 1e3:.1f} ms self CPU a token")
for r in rows[:a.top]:
    print(f"{r.key[:60]:60s} {r.self_cpu_time_total / n / 1e3:6.2f} ms/token {r.count / n:7.1f} calls/token "
          f"{100 * r.self_cpu_time_total / total:5.1f} %")
