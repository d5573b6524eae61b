"""Session 78: `generate`'s defaults with ChainChoice (a greedy step whose context lookup found a chain verifies it
alone where that is priced to beat the drafter's tree with the chain merged: decode/fallback.py) against the same
defaults with every found chain merged (the rule before), prompt lookup alone and the plain loop, on MT-bench first
turns and EAGLE's summarisation / QA / HumanEval subsets (chat template, T=0). Each drafter engine has its own
monitor (primed apart on the same prompts), so each learns from its own steps.

    python benchmarks/results/s78/chain_choice.py --limit 16 --per-workload 8 --out FILE.json [--dtype float32]
    ... --margins 0.1                                   # more engines with StreamMonitor.chain_margin set
    ... --workloads humaneval --twin --skip lookup      # a second `merged` engine (merged2): the A/A spread
"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from bench_core import (identical_to, primed_environment, primed_parser, primed_prompts, primed_run,  # noqa: E402
                        rotated_rows, workload_summary)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--per-workload", type=int, default=8)
p.add_argument("--workloads", default="sum,qa,humaneval")
p.add_argument("--dtype", default="auto", help="float32: every method's greedy output is the target's own (bf16 "
               "verifies of different widths round differently, and the texts then part)")
p.add_argument("--sum", type=int, default=16, help="summarisation prompts (the workload where chains win most)")
p.add_argument("--margins", default="", help="comma-separated chain margins to run as more engines (method margin<M>)")
p.add_argument("--twin", action="store_true", help="a second engine like `merged` (method merged2): an A/A control")
p.add_argument("--skip", default="", help="comma-separated methods not to run (e.g. lookup; plain is the baseline)")
args = p.parse_args()
timed, priming = primed_prompts(args)
METHODS = ["plain", "lookup", "default", "merged"]

plain = load("smollm2-135m-instruct", dtype=args.dtype, threads=args.threads, compile=True, remember=False)
spec = load("smollm2-135m-instruct", args.drafter, dtype=args.dtype, threads=args.threads, compile=True, remember=False)
merged = load("smollm2-135m-instruct", args.drafter, dtype=args.dtype, threads=args.threads, compile=True, remember=False)
merged.monitor.chain_choice = None  # every found chain merged into the drafter's tree (before session 78)
engines = {"plain": plain, "lookup": plain, "default": spec, "merged": merged}
for margin in filter(None, args.margins.split(",")):
    engines[f"margin{margin}"] = load("smollm2-135m-instruct", args.drafter, dtype=args.dtype, threads=args.threads,
                                      compile=True, remember=False)
    engines[f"margin{margin}"].monitor.chain_margin = float(margin)
    METHODS.append(f"margin{margin}")
if args.twin:
    engines["merged2"] = load("smollm2-135m-instruct", args.drafter, dtype=args.dtype, threads=args.threads,
                              compile=True, remember=False)
    engines["merged2"].monitor.chain_choice = None
    METHODS.append("merged2")
METHODS = [m for m in METHODS if m not in args.skip.split(",")]
tok = plain.tokenizer
jobs = [("mt_bench", plain.encode(t, chat=True)) for t in timed]
for w in args.workloads.split(","):
    n = args.sum if w == "sum" else args.per_workload
    jobs += [(w, encode(tok, q, [])) for q in load_workload(w, n, tok, "../shared/data")]


def run(method, ids):
    engine = engines[method]
    r = engine.generate(ids, max_new_tokens=args.max_new_tokens, speculative=method != "plain",
                        lookup=LookupSettings() if method == "lookup" else "default")
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "tokens": r.token_ids,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens, "plain_steps": s.target_forwards - 1,
            "copied_steps": s.copied_steps}


primed_run(METHODS, run, jobs, lambda: [engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens)
                                            for prompt in priming for m, engine in engines.items()
                                            if m not in ("plain", "lookup")])
rows = rotated_rows(jobs, METHODS, run, identical_to(METHODS, "plain"))
summary = workload_summary(rows, METHODS, ["mt_bench"] + args.workloads.split(","), "default")
env = {**primed_environment(args, plain.target.dtype), "timed": len(jobs), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
