"""Prompt lookup with no drafter (session 75): the project's loop drafting only the chain copied from the text
itself (decode/lookup.py), against the plain loop, Hugging Face `generate` with and without its prompt lookup, and
`generate`'s defaults with the released drafter, on MT-bench first turns and EAGLE's GSM8K / HumanEval / QA /
summarisation subsets (chat template, T=0).

The project's engines are AOT-compiled (`load(compile=True)`, as `generate` runs by default once compiled); the
drafter's engine is primed on `--prime` MT-bench turns (untimed) so its measured shape has settled. Hugging Face
runs the same dtype, eager, as it ships. Methods rotate per prompt; ratios are per prompt against the plain loop.

    python benchmarks/results/s75/prompt_lookup.py --limit 24 --per-workload 8 --threads 2 --out FILE.json
"""
import json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.bench.methods import PROMPT_LOOKUP_TOKENS, HFGenerate  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from anchorspec.models.target import stock_twin  # noqa: E402
from bench_core import (method_summary, paired_median, primed_environment, primed_parser, primed_prompts,  # noqa: E402
                        rotated_rows)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--per-workload", type=int, default=8, help="prompts of each EAGLE subset (gsm8k, humaneval, qa, sum)")
p.add_argument("--workloads", default="gsm8k,humaneval,qa,sum")
args = p.parse_args()
timed, priming = primed_prompts(args)
METHODS = ["plain", "lookup", "drafter", "hf", "hf_lookup"]

plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
spec = load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
tok = plain.tokenizer
stop = plain.stop_token_ids()
stock = stock_twin(load("smollm2-135m-instruct", threads=args.threads).target, "smollm2-135m-instruct",
                   plain.target.dtype)
hf = {"hf": HFGenerate(stock, stop), "hf_lookup": HFGenerate(stock, stop, prompt_lookup=PROMPT_LOOKUP_TOKENS)}
jobs = [("mt_bench", plain.encode(t, chat=True)) for t in timed]
for w in args.workloads.split(","):
    jobs += [(w, encode(tok, q, [])) for q in load_workload(w, args.per_workload, tok, "../shared/data")]


def run(method, ids):
    if method in hf:
        r = hf[method].run(ids, args.max_new_tokens, 0.0, 0)
        return {"tok_s": len(r.tokens) / r.seconds, "steps": 0, "accepted": 0, "tokens": r.tokens}
    engine = spec if method == "drafter" else plain
    r = engine.generate(ids, max_new_tokens=args.max_new_tokens, speculative=method != "plain",
                        lookup=LookupSettings() if method == "lookup" else "default")
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "tokens": r.token_ids,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens, "plain_steps": s.target_forwards - 1}


for m in METHODS:  # first calls: allocations, kernel choice
    run(m, jobs[0][1][:32])
for prompt in priming:
    spec.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens)
print("primed", flush=True)


def identical_to_plain(row):
    for m in METHODS:
        row[m]["identical"] = row[m].pop("tokens") == row["plain"]["tokens"] if m != "plain" else True
    row["plain"].pop("tokens")


rows = rotated_rows(jobs, METHODS, run, identical_to_plain)
summary = {}
for w in ["all", "mt_bench"] + args.workloads.split(","):
    rs = [r for r in rows if w in ("all", r["workload"])]
    for m in METHODS:
        steps = sum(r[m]["steps"] for r in rs)
        x = summary[f"{w} | {m}"] = {**method_summary(rs, m), "identical": sum(r[m]["identical"] for r in rs),
                                     "prompts": len(rs), "vs_hf_median": paired_median(rs, m, "hf")}
        print(f"{w:9s} {m:9s} {x['median_tok_s']:6.1f} tok/s  {x['median_vs_plain']:.2f}x plain "
              f"(min {x['min_vs_plain']:.2f})  {x['vs_hf_median']:.2f}x HF  tau "
              f"{'-' if x['tau'] is None else round(x['tau'], 2)}  identical {x['identical']}/{len(rs)}")
env = {**primed_environment(args, plain.target.dtype), "timed": len(jobs), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
