"""Prompt lookup with no drafter when sampling (session 75): at T=0.7 top-p 0.9 (what chat clients send most) and T=1,
on MT-bench first turns, against the plain loop and `generate`'s defaults with the released drafter (its lookup chain
on, as by default). The copied tokens are point-mass candidates (decode/verify.py).

Each setting its own engines (the drafter's primed on `--prime` other turns at the setting, untimed); seed = prompt
index; methods rotated per prompt; ratios per prompt against the plain loop (different sampled texts: not paired).

    python benchmarks/results/s75/prompt_lookup_sampled.py --limit 24 --prime 12 --threads 2 --out FILE.json
"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from bench_core import method_summary, primed_environment, primed_parser, primed_prompts, rotated_rows  # noqa: E402

SETTINGS = {"T=0.7 top-p 0.9": (0.7, 0.9), "T=1": (1.0, 1.0)}
METHODS = ["plain", "lookup", "drafter"]
p = primed_parser(__doc__.split("\n\n")[0])
args = p.parse_args()
timed, priming = primed_prompts(args)
plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
drafters = {s: load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
            for s in SETTINGS}


jobs = [("mt_bench", plain.encode(text, chat=True)) for text in timed]
seed_of = {id(ids): i for i, (_, ids) in enumerate(jobs)}  # seed = prompt index, the same for every method


def run(setting, method, ids, seed):
    t, top_p = SETTINGS[setting]
    engine = drafters[setting] if method == "drafter" else plain
    r = engine.generate(ids, max_new_tokens=args.max_new_tokens, temperature=t, top_p=top_p, seed=seed,
                        speculative=method != "plain", lookup=LookupSettings() if method == "lookup" else "default")
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "new": s.new_tokens,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens}


for setting in SETTINGS:
    for i, text in enumerate(priming):
        run(setting, "drafter", plain.encode(text, chat=True), 1000 + i)
print("primed", flush=True)
summary, records = {}, {}
for setting in SETTINGS:
    rows = records[setting] = rotated_rows(jobs, METHODS, lambda m, ids: run(setting, m, ids, seed_of[id(ids)]))
    for m in METHODS:
        x = summary[f"{setting} | {m}"] = method_summary(rows, m)
        steps = sum(r[m]["steps"] for r in rows)
        x["lookup_tokens_per_step"] = sum(r[m]["lookup_tokens"] for r in rows) / steps if steps else None
        print(f"{setting:16s} {m:8s} {x['median_tok_s']:6.1f} tok/s  {x['median_vs_plain']:.2f}x plain "
              f"(min {x['min_vs_plain']:.2f})  tau {'-' if x['tau'] is None else round(x['tau'], 2)}")
env = {**primed_environment(args, plain.target.dtype), "timed": len(jobs), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": records}, indent=1) + "\n")
