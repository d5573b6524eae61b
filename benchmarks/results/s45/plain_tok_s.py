"""One process's plain-loop speed (generate --no-spec's path): median ms a token over REPS 128-token greedy
generations of MT-bench's first prompt after a warm-up. Run under different environments (OpenMP wait
policy, threads) by omp_knobs.sh to see which per-step costs are the runtime's, not the model's.

    python benchmarks/results/s45/plain_tok_s.py [--threads 2] [--dtype auto] [--compile]"""
import argparse, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", default="auto")
ap.add_argument("--compile", action="store_true")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--label", default="")
a = ap.parse_args()
e = load("smollm2-135m-instruct", dtype=a.dtype, threads=a.threads, compile=a.compile)
ids = e.encode(load_prompts(DEFAULT_DATA, 1)[0]["text"], chat=True)
e.generate(ids, max_new_tokens=128, speculative=False)  # warm-up
ms = []
for _ in range(a.reps):
    t0 = time.perf_counter()
    n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
    ms.append((time.perf_counter() - t0) / n * 1e3)
print(f"{a.label:28s} {e.target.dtype} threads {a.threads} compile {a.compile}: "
      f"{statistics.median(ms):.1f} ms/token (min {min(ms):.1f}, max {max(ms):.1f}) {1e3 / statistics.median(ms):.1f} tok/s")
