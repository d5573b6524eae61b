#!/usr/bin/env python
"""Session 71: sampled trees at T=1 end to end (issue 12's T=1 goal). The round-24 release on MT-bench first turns
(chat template, 128 new tokens, T=1, one seed per prompt and method), speculation forced at every step
(fallback off), each shape against the project's plain loop in the same process, methods rotated per prompt.
Chains are today's T=1 drafts; a tree shape k,d,t at T>0 now drafts k candidates from q without replacement at the
first level and a sampled chain below each (decode/tree.py sampled_tree), verified by recursive rejection."""
import json
import sys
import time

sys.path.insert(0, "benchmarks")
from bench_core import DEFAULT_DATA, in_turns, load_prompts, median, model_parser, target_and_drafter  # noqa: E402

from anchorspec.api import Engine  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

p = model_parser(__doc__.split("\n\n")[0], dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--limit", type=int, default=24)
p.add_argument("--every", type=int, default=3)
p.add_argument("--shapes", nargs="+", default=["1,3,4", "1,4,5", "2,3,7", "2,4,9", "3,3,10", "4,3,13"])
p.add_argument("--out", required=True)
args = p.parse_args()
target, drafter = target_and_drafter(args)
engine = Engine(target, drafter, fallback=False)
methods = ["plain"] + args.shapes
rows = {m: [] for m in methods}
prompts = load_prompts(DEFAULT_DATA, args.limit, every=args.every)
engine.generate("Hello", chat=True, max_new_tokens=8, speculative=False)  # warm-up
for i, q in enumerate(prompts):
    ids = engine.encode(q["text"], True, None)
    for m in in_turns(methods, i):
        t0 = time.perf_counter()
        out = engine.generate(ids, max_new_tokens=128, temperature=1.0, seed=1000 + i, speculative=m != "plain",
                              shape=None if m == "plain" else TreeShape.parse(m))
        dt = time.perf_counter() - t0
        s = out.stats
        rows[m].append({"tokens": len(out.token_ids), "seconds": dt, "steps": s.verify_steps,
                        "accepted": s.accepted_tokens, "drafted": s.drafted_tokens})
    print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
report = {}
print(f"| shape (bf16? {args.dtype}, {args.threads} threads, {len(prompts)} prompts, T=1) | tau | verify rows a step "
      "| tok/s | vs plain (median per prompt) |")
print("|---|---|---|---|---|")
for m in methods:
    r = rows[m]
    tok, sec = sum(x["tokens"] for x in r), sum(x["seconds"] for x in r)
    steps = sum(x["steps"] for x in r)
    tau = (sum(x["accepted"] for x in r) + steps) / steps if steps else float("nan")
    per = median([(x["tokens"] / x["seconds"]) / (y["tokens"] / y["seconds"]) for x, y in zip(r, rows["plain"])])
    report[m] = {"tau": tau, "rows_per_step": (sum(x["drafted"] for x in r) + steps) / steps if steps else 1.0,
                 "tok_per_s": tok / sec, "vs_plain_median": per, "rows": r}
    print(f"| {m} | {tau:.3f} | {report[m]['rows_per_step']:.2f} | {tok / sec:.1f} | {per:.3f} |")
json.dump({"args": vars(args), "report": report}, open(args.out, "w"), indent=1)
