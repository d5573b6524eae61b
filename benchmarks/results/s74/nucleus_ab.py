"""Top-p without sorting the vocabulary, against the sort (session 74), at T=0.7 top-p 0.9 on MT-bench first turns.

`probs_from_logits` cut every row's nucleus after sorting all 49,152 probabilities: 3.4 ms a row on a CPU thread,
about a plain step's cost, paid by every row the target verifies and every drafter row that drafts. Session 74's
`nucleus` finds the same cut among the row's largest 128 tokens (then 8x more while the head's mass falls short
of top-p). Both rules run here in one process (the old one patched back in as `sorted_nucleus`, the test suite's
oracle), each with engines of its own primed on `--prime` prompts at the setting; methods rotate per prompt:

    plain-sort, plain    the plain loop with the old and the new cut
    default-sort, default  `generate`'s defaults (a measured chain) with the old and the new cut
    +trees               the new cut, the candidate trees priced beside the chains

    python benchmarks/results/s74/nucleus_ab.py --limit 24 --prime 12 --threads 2 --out FILE.json
"""
import json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import anchorspec.decode.sampling as sampling  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.decode.fallback import TREE_CANDIDATES, shape_key  # noqa: E402
from bench_core import (in_turns, method_summary, paired_median, primed_environment, primed_parser,  # noqa: E402
                        primed_prompts)
from test_sampling import sorted_nucleus  # noqa: E402

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--temperature", type=float, default=0.7)
p.add_argument("--top-p", type=float, default=0.9)
args = p.parse_args()
timed, priming = primed_prompts(args)
fast_nucleus = sampling.nucleus
CUTS = {"sort": sorted_nucleus, "head": fast_nucleus}


def run(engine, prompt, seed, cut, **kw):
    sampling.nucleus = CUTS[cut]
    try:
        r = engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=seed, lookup=None, **kw)  # as recorded: before lookup when sampling
    finally:
        sampling.nucleus = fast_nucleus
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "new": s.new_tokens}


def speculative_engine(trees=False):
    e = load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
    if trees:
        e.candidate_trees = lambda sampling: TREE_CANDIDATES
    return e


plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
methods = {"plain-sort": (plain, "sort"), "plain": (plain, "head"), "default-sort": (speculative_engine(), "sort"),
           "default": (speculative_engine(), "head"), "+trees": (speculative_engine(trees=True), "head")}
for e, cut in methods.values():
    e.generate("Hello", chat=True, max_new_tokens=8, temperature=0.0)
    if e is not plain:
        for i, prompt in enumerate(priming):
            run(e, prompt, 1000 + i, cut)
print("primed", flush=True)
rows = []
for i, prompt in enumerate(timed):
    row = {"prompt": i}
    for m in in_turns(list(methods), i):
        e, cut = methods[m]
        row[m] = run(e, prompt, i, cut, speculative=not m.startswith("plain"))
        if not m.startswith("plain"):
            row[m]["shape"] = shape_key(e.shape_for(sampling.SamplingParams(args.temperature, args.top_p)))
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {}
for m in methods:
    s = summary[m] = {**method_summary(rows, m, "plain-sort"), **method_summary(rows, m)}
    print(f"{m:13s} {s['median_tok_s']:6.1f} tok/s  {s['median_vs_plain_sort']:.2f}x plain-sort  "
          f"{s['median_vs_plain']:.2f}x plain  tau {s['tau'] if s['tau'] is None else round(s['tau'], 2)}  {s['shapes']}")
paired = {"default / default-sort": paired_median(rows, "default", "default-sort"),
          "+trees / default": paired_median(rows, "+trees", "default")}
print("paired medians per prompt:", json.dumps(paired))
env = {**primed_environment(args, plain.target.dtype), "timed": len(timed), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "paired": paired, "rows": rows},
                                     indent=1) + "\n")
