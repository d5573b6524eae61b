"""Where the project's plain loop spends a token (generate --no-spec's path, `--dtype auto`): torch.profiler
over one 128-token generation after a warm-up, self CPU time per op, per generated token; then the same
generation timed without the profiler. Compare the linear ops' share with gemv_bandwidth.py's 11.4 ms.

    python benchmarks/results/s44/plain_step_profile.py"""
import sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402

e = load("smollm2-135m-instruct", dtype="auto", threads=2)
ids = e.encode(load_prompts(DEFAULT_DATA, 1)[0]["text"], chat=True)
e.generate(ids, max_new_tokens=128, speculative=False)  # warm-up
t0 = time.perf_counter()
n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
plain = (time.perf_counter() - t0) / n
with profile(activities=[ProfilerActivity.CPU]) as prof:
    n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
print(f"{e.target.dtype}, 2 threads: {plain * 1e3:.1f} ms a token unprofiled ({1 / plain:.1f} tok/s), {n} tokens")
rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
total = sum(a.self_cpu_time_total for a in rows)
print(f"profiled: {total / n / 1e3:.1f} ms self CPU a token")
for a in rows[:18]:
    print(f"{a.key[:48]:48s} {a.self_cpu_time_total / n / 1e3:6.2f} ms/token {a.count / n:6.1f} calls/token "
          f"{100 * a.self_cpu_time_total / total:5.1f} %")
