"""The fallback's plain steps keep the lookup chain (session 75): where the stream monitor finds the drafter not
paying, a solo step still verifies a chain copied from the text (kind "lookup", no drafter pass) instead of one
token. Before/after in one run, with a random drafter (the monitor keeps it off) and the round-24 release, against
the plain loop and prompt lookup with no drafter, on MT-bench first turns and EAGLE's summarisation subset (T=0).

"before" runs the same engine with the old rule (a switched-off step verifies the pending token alone), patched in
for its calls only. Engines AOT-compiled and primed on `--prime` other MT-bench turns; methods rotated per prompt.

    python benchmarks/results/s75/fallback_lookup.py --random DIR --limit 24 --per-workload 8 --out FILE.json
"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import anchorspec.decode.engine as engine_module  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from bench_core import (method_summary, paired_median, primed_environment, primed_parser, primed_prompts,  # noqa: E402
                        rotated_rows)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--random", required=True, help="a randomly initialised drafter (anchorspec init-drafter)")
p.add_argument("--per-workload", type=int, default=8)
args = p.parse_args()
timed, priming = primed_prompts(args)
NEW_RULE = engine_module.SpeculativeDecoding._looks_up_alone


def old_rule(self, speculate):
    return NEW_RULE(self, speculate) and self.proposer is None


plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
engines = {f"{name}-{rule}": load("smollm2-135m-instruct", path, threads=args.threads, compile=True, remember=False)
           for name, path in (("random", args.random), ("r24", args.drafter)) for rule in ("before", "after")}
METHODS = ["plain", "lookup", *engines]
jobs = [("mt_bench", plain.encode(t, chat=True)) for t in timed]
jobs += [("sum", encode(plain.tokenizer, q, [])) for q in load_workload("sum", args.per_workload, plain.tokenizer,
                                                                          "../shared/data")]


def run(method, ids):
    engine = engines.get(method, plain)
    engine_module.SpeculativeDecoding._looks_up_alone = old_rule if method.endswith("before") else NEW_RULE
    r = engine.generate(ids, max_new_tokens=args.max_new_tokens, speculative=method != "plain",
                        lookup=LookupSettings() if method == "lookup" else "default")
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "new": s.new_tokens,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens, "switches": s.fallback_switches}


for m in METHODS:
    run(m, jobs[0][1][:32])
for m in engines:
    for prompt in priming:
        run(m, plain.encode(prompt, chat=True))
print("primed", flush=True)
rows = rotated_rows(jobs, METHODS, run)
summary = {}
for w in ("all", "mt_bench", "sum"):
    rs = [r for r in rows if w in ("all", r["workload"])]
    for m in METHODS:
        x = summary[f"{w} | {m}"] = method_summary(rs, m)
        print(f"{w:8s} {m:13s} {x['median_tok_s']:6.1f} tok/s  {x['median_vs_plain']:.2f}x plain "
              f"(min {x['min_vs_plain']:.2f})  tau {'-' if x['tau'] is None else round(x['tau'], 2)}")
    for name in ("random", "r24"):
        summary[f"{w} | {name} after/before, paired median"] = x = paired_median(rs, f"{name}-after", f"{name}-before")
        print(f"{w:8s} {name}: after / before, median per prompt {x:.3f}")
env = {**primed_environment(args, plain.target.dtype), "timed": len(jobs), "priming": len(priming),
       "random": args.random}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
