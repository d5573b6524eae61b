"""The context-lookup chain in sampled drafts (session 74): its copied tokens as fixed candidates beside the drawn
ones (decode/verify.py), against the drafter alone, at T=0.7 top-p 0.9 and at T=1, on MT-bench first turns.

Each setting gets its own engines (drafter alone; drafter + lookup), primed on `--prime` prompts at the setting
(untimed), then timed on `--limit` others with the plain loop, methods rotated per prompt, seed = prompt index.

    python benchmarks/results/s74/sampled_lookup.py --limit 24 --prime 12 --threads 2 --out FILE.json
"""
import json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from bench_core import (in_turns, method_summary, paired_median, primed_environment, primed_parser,  # noqa: E402
                        primed_prompts)

SETTINGS = {"T=0.7 top-p 0.9": (0.7, 0.9), "T=1": (1.0, 1.0)}
METHODS = {"plain": None, "drafter": None, "+lookup": LookupSettings()}

p = primed_parser(__doc__.split("\n\n")[0])
args = p.parse_args()
timed, priming = primed_prompts(args)


def run(engine, prompt, setting, seed, method):
    t, top_p = SETTINGS[setting]
    r = engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=t, top_p=top_p, seed=seed,
                        speculative=method != "plain", lookup=METHODS[method])
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "new": s.new_tokens,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens}


plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
engines = {s: {m: load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
               for m in ("drafter", "+lookup")} for s in SETTINGS}
for e in [plain] + [e for es in engines.values() for e in es.values()]:
    e.generate("Hello", chat=True, max_new_tokens=8, temperature=0.0)
for s, es in engines.items():
    for m, e in es.items():
        for i, prompt in enumerate(priming):
            run(e, prompt, s, 1000 + i, m)
print("primed", flush=True)
rows = []
for i, prompt in enumerate(timed):
    for s, es in engines.items():
        row = {"prompt": i, "setting": s}
        for m in in_turns(list(METHODS), i):
            row[m] = run(plain if m == "plain" else es[m], prompt, s, i, m)
        rows.append(row)
        print(json.dumps(row), flush=True)
summary = {}
for s in SETTINGS:
    rs = [r for r in rows if r["setting"] == s]
    for m in METHODS:
        steps = sum(r[m]["steps"] for r in rs)
        summary[f"{s} | {m}"] = x = {
            **method_summary(rs, m),
            "lookup_rows_per_step": sum(r[m]["lookup_rows"] for r in rs) / steps if steps else None,
            "lookup_tokens_per_step": sum(r[m]["lookup_tokens"] for r in rs) / steps if steps else None}
        print(f"{s:16s} {m:8s} {x['median_tok_s']:6.1f} tok/s  {x['median_vs_plain']:.2f}x plain  tau "
              f"{x['tau'] if x['tau'] is None else round(x['tau'], 2)}  lookup rows/tokens a step "
              f"{x['lookup_rows_per_step']} / {x['lookup_tokens_per_step']}")
    paired = paired_median(rs, "+lookup", "drafter")
    summary[f"{s} | +lookup / drafter, paired median"] = paired
    print(f"{s}: +lookup / drafter, median per prompt {paired:.3f}")
env = {**primed_environment(args, plain.target.dtype), "timed": len(timed), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
