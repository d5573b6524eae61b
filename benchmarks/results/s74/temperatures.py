"""Speculation at the sampling settings chat users set (session 74): T=0.7 with top-p 0.9, T=0.7, T=1, and T=0.

Every figure so far for sampled decoding was at T=1 with no truncation, the hardest case. Here each setting
gets engines of its own (a deployment serves one setting), each primed with `--prime` MT-bench first turns at
that setting (untimed), then timed on `--limit` others (disjoint: every 3rd from 1 and from 0), methods
rotated per prompt, seed = prompt index:

    plain          the plain loop (one engine for all settings: it learns nothing)
    default        `generate`'s defaults (sampled decoding: a measured chain; T=0: chain or tree, and lookup; the
                   recorded run predates the lookup chain in sampled drafts, which is on by default since)
    +trees         sampled settings only: the candidate trees priced beside the chains (as greedy has them)
    tree-4,4,16    sampled settings only: the 4,4,16 tree given (no choice), whose steps also give the tree's
                   accepted tokens per token its top-1 chain accepted (the prior PRIOR_TREE_RATIO[SAMPLED])

    python benchmarks/results/s74/temperatures.py --limit 24 --prime 12 --threads 2 --out FILE.json
"""
import json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.decode.fallback import TREE_CANDIDATES, shape_key  # noqa: E402
from anchorspec.decode.sampling import SamplingParams  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from bench_core import in_turns, method_summary, primed_environment, primed_parser, primed_prompts  # noqa: E402

SETTINGS = {"T=0.7 top-p 0.9": (0.7, 0.9), "T=0.7": (0.7, 1.0), "T=1": (1.0, 1.0), "T=0": (0.0, 1.0)}
TREE = TreeShape(4, 4, 16)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names from: " + ", ".join(SETTINGS))
args = p.parse_args()
timed, priming = primed_prompts(args)
settings = {name: SETTINGS[name] for name in args.settings.split(",")}


def speculative_engine(trees=False):
    e = load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
    if trees:
        e.candidate_trees = lambda sampling: TREE_CANDIDATES
    return e


def run(engine, prompt, setting, seed, **kw):
    t, top_p = settings[setting]
    r = engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=t, top_p=top_p,
                        seed=seed, **kw)
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "new": s.new_tokens,
            "explored": s.explored_steps}


plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
engines = {}
for name, (t, _) in settings.items():
    engines[name] = {"default": speculative_engine()}
    if t > 0:
        engines[name]["+trees"] = speculative_engine(trees=True)
        engines[name]["tree-4,4,16"] = speculative_engine()
for e in [plain] + [e for es in engines.values() for e in es.values()]:
    e.generate("Hello", chat=True, max_new_tokens=8, temperature=0.0)
for name, es in engines.items():
    for m, e in es.items():
        for i, prompt in enumerate(priming):
            run(e, prompt, name, 1000 + i, **({"shape": TREE} if m.startswith("tree") else {}))
    print(f"{name}: primed", flush=True)

rows = []
for i, prompt in enumerate(timed):
    for name, es in engines.items():
        row = {"prompt": i, "setting": name}
        for m in in_turns(["plain", *es], i):
            if m == "plain":
                row[m] = run(plain, prompt, name, i, speculative=False)
                continue
            e = es[m]
            shape = TREE if m.startswith("tree") else e.shape_for(SamplingParams(*settings[name]))
            row[m] = run(e, prompt, name, i, **({"shape": TREE} if m.startswith("tree") else {}))
            row[m]["shape"] = shape_key(shape)
        rows.append(row)
        print(json.dumps(row), flush=True)

summary = {}
for name, es in engines.items():
    rs = [r for r in rows if r["setting"] == name]
    for m in ["plain", *es]:
        s = summary[f"{name} | {m}"] = method_summary(rs, m)
        tau = s["tau"]
        print(f"{name:16s} {m:12s} {s['median_tok_s']:6.1f} tok/s  {s['median_vs_plain']:.2f}x plain "
              f"({s['min_vs_plain']:.2f}-{s['max_vs_plain']:.2f})  tau {tau if tau is None else round(tau, 2)}  "
              f"{s['shapes']}")
monitors = {}
for name, es in engines.items():
    for m, e in es.items():
        e.monitor.select(SamplingParams(*settings[name]))
        monitors[f"{name} | {m}"] = {"acceptance": [round(e.monitor.acceptance(d), 3) for d in range(1, 8)],
                                     "trees": dict(e.monitor.trees)}
        if m.startswith("tree"):
            steps, accepted, top = e.monitor.trees.get(shape_key(TREE), (0, 0, 0))
            print(f"{name}: tree {shape_key(TREE)} {steps} steps, ratio over its top-1 chain {accepted / top if top else None}")
env = {**primed_environment(args, plain.target.dtype), "timed": len(timed), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "monitors": monitors, "rows": rows},
                                     indent=1) + "\n")
