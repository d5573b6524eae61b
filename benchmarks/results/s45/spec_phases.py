"""Where a speculative step's time goes, eager or compiled: `generate`'s defaults with the EAGLE-3.1 release
on the first N MT-bench first turns (chat template, T=0, 128 new tokens), each after one warm-up
generation; the engine's own timers (prefill, drafting, verification, the rest: acceptance, cache commits,
the shape monitor, Python) per verify step, against the same engine's plain step.

    python benchmarks/results/s45/spec_phases.py [--compile] [--no-fallback] [--limit 10] [--threads 2]
(--no-fallback since session 46)"""
import argparse, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, REPO_ROOT, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--compile", action="store_true")
ap.add_argument("--no-fallback", action="store_true", help="speculate at every step (load(fallback=False))")
ap.add_argument("--limit", type=int, default=10)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
t0 = time.perf_counter()
e = load("smollm2-135m-instruct", str(REPO_ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"), dtype="auto",
         threads=a.threads, compile=a.compile, fallback=not a.no_fallback)
print(f"load: {time.perf_counter() - t0:.0f} s", flush=True)
tot = dict(prefill=0.0, draft=0.0, verify=0.0, total=0.0, steps=0, plain_steps=0, tokens=0, plain_s=0.0, accepted=0)
for p in load_prompts(DEFAULT_DATA, a.limit):
    ids = e.encode(p["text"], chat=True)
    e.generate(ids, max_new_tokens=128)  # warm-up: the stream's costs, the host's caches
    s = e.generate(ids, max_new_tokens=128).stats
    tot["prefill"] += s.prefill_s; tot["draft"] += s.draft_s; tot["verify"] += s.verify_s; tot["total"] += s.total_s
    tot["steps"] += s.verify_steps; tot["plain_steps"] += s.target_forwards - 1 - s.verify_steps
    tot["tokens"] += s.new_tokens; tot["accepted"] += s.accepted_tokens
    t1 = time.perf_counter()
    n = len(e.generate(ids, max_new_tokens=128, speculative=False).token_ids)
    tot["plain_s"] += time.perf_counter() - t1; tot["plain_tokens"] = tot.get("plain_tokens", 0) + n
rest = tot["total"] - tot["prefill"] - tot["draft"] - tot["verify"]
st = max(tot["steps"], 1)
plain_ms = tot["plain_s"] / tot["plain_tokens"] * 1e3
print(f"{e.target.dtype}, compile {a.compile}, fallback {not a.no_fallback}, shape {e.shape} ({e.shape_source}), {a.threads} threads, {a.limit} prompts: {tot['tokens'] / tot['total']:.1f} tok/s "
      f"speculative, {1e3 / plain_ms:.1f} plain ({plain_ms:.1f} ms a token); {tot['steps']} verify steps, "
      f"{tot['plain_steps']} fallback plain steps, tau {(tot['accepted'] + tot['steps']) / st:.2f}")
print(f"per verify step: drafting {tot['draft'] / st * 1e3:.1f} ms, verification {tot['verify'] / st * 1e3:.1f} ms, "
      f"the rest {rest / st * 1e3:.1f} ms (fallback steps included); prefill {tot['prefill'] / a.limit * 1e3:.0f} ms a prompt")
