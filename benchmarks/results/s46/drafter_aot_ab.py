"""The drafter's passes through its AOT graph or packed and eager, beside the same AOT-compiled target: two
engines in one process, `generate`'s defaults with the EAGLE-3.1 release, the order alternating per prompt,
each prompt once as a warm-up. Median tokens/s and drafting ms per verify step.

    python benchmarks/results/s46/drafter_aot_ab.py [--limit 10] [--threads 2] [--fixed]"""
import argparse, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, REPO_ROOT, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.models.packed import pack_linears  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--limit", type=int, default=10)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--fixed", action="store_true", help="EAGLE's 4,4,16 tree at every step (no fallback, no shape choice)")
a = ap.parse_args()
drafter = str(REPO_ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1")
engines = {}
for name in ("drafter AOT", "drafter packed eager"):
    e = load("smollm2-135m-instruct", drafter, dtype="auto", threads=a.threads, compile=True, remember=False,
             fallback=not a.fixed, shape=TreeShape(4, 4, 16) if a.fixed else None)
    if name != "drafter AOT":
        e.drafter.compile(False)
        pack_linears(e.drafter, keep_weights=True)
    engines[name] = e
rows = {n: [] for n in engines}
for i, p in enumerate(load_prompts(DEFAULT_DATA, a.limit)):
    order = list(engines) if i % 2 == 0 else list(engines)[::-1]
    for n in order:
        e = engines[n]
        ids = e.encode(p["text"], chat=True)
        e.generate(ids, max_new_tokens=128)  # warm-up
        s = e.generate(ids, max_new_tokens=128).stats
        rows[n].append((s.new_tokens / s.total_s, s.draft_s / max(s.verify_steps, 1) * 1e3, s.verify_steps))
for n, r in rows.items():
    print(f"{n:22s} {statistics.median(x[0] for x in r):6.1f} tok/s (median of {len(r)} prompts), drafting "
          f"{statistics.median(x[1] for x in r):5.1f} ms per verify step, {sum(x[2] for x in r)} verify steps")
e = next(iter(engines.values()))
print(f"{e.target.dtype}, {a.threads} threads, target AOT-compiled in both; "
      f"{'fixed 4,4,16 tree, no fallback' if a.fixed else 'defaults (own shape choice and fallback each)'}")
