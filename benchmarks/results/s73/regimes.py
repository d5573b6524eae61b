"""Acceptance kept per sampling regime against one set for all (session 73), round-24 release + lookup.

A process that decodes both greedy and sampled requests (the API, a notebook, a costs file that outlives its
process) used to price and judge both on one set of acceptance figures. Here every speculative engine first
decodes `--prime` MT-bench first turns greedily (untimed: what a costs file kept from earlier greedy runs looks
like), then the timed prompts alternate T=0 and T=1 (seed = prompt index), methods rotated per prompt:

    plain          the plain loop (the baseline at each temperature)
    one-set        session 72's rule: one acceptance set and one global window for both regimes, and sampled
                   decoding drafts greedy's chain when greedy's measured shape is a chain
    regimes        session 73: acceptance and the global window per regime, sampled decoding on chains only
    regimes+trees  the same, with the candidate trees priced for sampled decoding too

Before that, a separate engine drafts the 4,4,16 tree at T=0 and T=1 on the priming prompts (shape given), to
measure the tree's accepted tokens per token its top-1 chain had accepted in each regime (the tree ratio's prior).
Timed and priming prompts are disjoint (every 3rd from 0 and from 1).

    python benchmarks/results/s73/regimes.py --limit 27 --prime 27 --threads 2 --out FILE.json
"""
import argparse, json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.decode.fallback import GREEDY, SAMPLED, TREE_CANDIDATES  # noqa: E402
from anchorspec.decode.sampling import SamplingParams  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.models.dtype import cpu_description  # noqa: E402
from bench_core import in_turns, load_prompts, method_summary, warn_if_busy  # noqa: E402

METHODS = ["one-set", "regimes", "regimes+trees"]

p = argparse.ArgumentParser()
p.add_argument("--drafter", default="checkpoints/smollm2-135m-instruct-eagle3.1")
p.add_argument("--data", default="../shared/data/mt_bench/question.jsonl")
p.add_argument("--limit", type=int, default=27)
p.add_argument("--prime", type=int, default=27)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
warn_if_busy(args.threads)
timed = [q["text"] for q in load_prompts(args.data, args.limit, 3, 0)]
priming = [q["text"] for q in load_prompts(args.data, args.prime, 3, 1)]


def speculative_engine():
    return load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)


def one_set(engine):
    """Session 72's monitor and shape rule on session 73's code: both regimes share one acceptance set and one
    global window, and sampled decoding keeps greedy's measured shape when that is a chain."""
    m = engine.monitor
    m.learned[SAMPLED] = m.learned[GREEDY]
    m.recent_by_regime[SAMPLED] = m.recent_by_regime[GREEDY]
    chains_only = engine.shape_for

    def shape_for(sampling):
        shape = engine.shape
        return shape if sampling.greedy or shape.is_chain else chains_only(sampling)

    engine.shape_for = shape_for
    return engine


def with_sampled_trees(engine):
    engine.candidate_trees = lambda sampling: TREE_CANDIDATES
    return engine


def run(engine, prompt, temperature, seed, **kw):
    r = engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed, **kw)
    return r, {"tok_s": r.stats.tokens_per_s, "steps": r.stats.verify_steps, "accepted": r.stats.accepted_tokens,
               "new": r.stats.new_tokens, "explored": r.stats.explored_steps}


# the tree ratio per regime, the shape given (a separate engine: it teaches the compared ones nothing)
probe = speculative_engine()
tree = TreeShape(4, 4, 16)
ratios = {}
for temperature, regime in ((0.0, GREEDY), (1.0, SAMPLED)):
    for i, prompt in enumerate(priming):
        run(probe, prompt, temperature, 1000 + i, shape=tree)
    probe.monitor.regime = regime
    steps, accepted, top = probe.monitor.trees.get("4,4,16", (0, 0, 0))
    ratios[regime] = {"steps": steps, "accepted": accepted, "top1_accepted": top, "ratio": accepted / top if top else None}
    print(f"tree 4,4,16 at T={temperature:g}: {steps} steps, {accepted} accepted, {top} by its top-1 chain: "
          f"ratio {ratios[regime]['ratio']}", flush=True)
del probe

plain_engine = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
engines = {"one-set": one_set(speculative_engine()), "regimes": speculative_engine(),
           "regimes+trees": with_sampled_trees(speculative_engine())}
for e in [plain_engine, *engines.values()]:
    for t in (0.0, 1.0):
        e.generate("Hello", chat=True, max_new_tokens=8, temperature=t, seed=0)
for name, e in engines.items():  # what earlier greedy runs would have left in a costs file
    for i, prompt in enumerate(priming):
        run(e, prompt, 0.0, i)
    print(f"{name}: primed, greedy shape {e._shape}", flush=True)

rows = []
for i, prompt in enumerate(timed):
    for temperature in (0.0, 1.0):
        row = {"prompt": i, "temperature": temperature}
        for m in in_turns(["plain", *METHODS], i):
            eng = plain_engine if m == "plain" else engines[m]
            # the shape generate() will start from (shape_for is what it calls; choosing again gives the same)
            shape = None if m == "plain" else str(eng.shape_for(SamplingParams(temperature)))
            _, row[m] = run(eng, prompt, temperature, i, speculative=m != "plain")
            row[m]["shape"] = shape
        rows.append(row)
        print(json.dumps(row), flush=True)

summary = {}
for temperature in (0.0, 1.0):
    rs = [r for r in rows if r["temperature"] == temperature]
    for m in ["plain", *METHODS]:
        s = summary[f"T={temperature:g} {m}"] = method_summary(rs, m)
        tau = s["tau"]
        print(f"T={temperature:g} {m:14s} {s['median_tok_s']:6.1f} tok/s  {s['median_vs_plain']:.2f}x plain "
              f"({s['min_vs_plain']:.2f}-{s['max_vs_plain']:.2f})  tau {tau if tau is None else round(tau, 2)}  "
              f"{s['shapes']}")
final = {}
for name, e in engines.items():
    final[name] = {}
    for regime in (GREEDY, SAMPLED):
        e.monitor.regime = regime
        final[name][regime] = {"acceptance": [round(e.monitor.acceptance(d), 3) for d in range(1, 8)],
                               "trees": dict(e.monitor.trees)}
    print(name, json.dumps(final[name]))
cpu = cpu_description()
env = {"cpu": cpu["model"], "flags": [f for f in cpu["flags"] if "avx512" in f or "amx" in f or f == "avx2"],
       "torch": torch.__version__, "threads": args.threads, "dtype": str(plain_engine.target.dtype),
       "drafter": args.drafter, "timed": len(timed), "priming": len(priming), "max_new_tokens": args.max_new_tokens}
Path(args.out).write_text(json.dumps({"environment": env, "tree_ratio": ratios, "summary": summary,
                                      "monitors": final, "rows": rows}, indent=1) + "\n")
