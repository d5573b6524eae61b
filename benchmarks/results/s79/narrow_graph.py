"""Session 79: the narrow-step graph (inductor's C++ GEMM template for steps of a few new rows, oneDNN's graph for
the rest: models/compiled.py) against the one oneDNN graph, for the plain loop and `generate`'s defaults (round-24
EAGLE-3.1 release, lookup chain), on MT-bench first turns and EAGLE's summarisation / QA / HumanEval subsets (chat
template, T=0); HF `generate` on the stock model as the outside baseline. Each engine is loaded with
ANCHORSPEC_NARROW_GRAPH set as its name says (read when its graphs load); each drafter engine has its own monitor,
primed apart on the same prompts; methods rotate per prompt.

    python benchmarks/results/s79/narrow_graph.py --limit 16 --per-workload 8 --out FILE.json [--dtype float32]
    ... --twin      # a second engine like `default_old` (method default_old2): the A/A spread
    ... --capped 16 # (session 80) one more engine whose twins serve at most 16 new rows (method default_new16)
"""
import json, os, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from bench_core import (hf_generate, identical_to, primed_environment, primed_parser, primed_prompts,  # noqa: E402
                        primed_run, rotated_rows, workload_summary)
from anchorspec.api import Engine  # noqa: E402
from anchorspec.models.target import stock_twin  # noqa: E402

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--per-workload", type=int, default=8)
p.add_argument("--workloads", default="sum,qa,humaneval")
p.add_argument("--dtype", default="auto")
p.add_argument("--twin", action="store_true")
p.add_argument("--capped", type=int, default=0, help="also an engine whose twins serve at most this many new rows")
p.add_argument("--skip", default="", help="comma-separated methods not to run (hf: the HF baseline)")
args = p.parse_args()
timed, priming = primed_prompts(args)
T = "smollm2-135m-instruct"


def engine(narrow: bool, drafter: bool, cap: int = 0):
    os.environ["ANCHORSPEC_NARROW_GRAPH"] = "on" if narrow else "off"
    e = load(T, args.drafter if drafter else None, dtype=args.dtype, threads=args.threads, compile=True,
             remember=False)
    e.warm_up()
    if cap:  # the crossover as a timing range of 1-`cap` rows could find it at most
        for graph in (e.target.load_graph(), *([e.drafter.load_graph()] if drafter else [])):
            graph.up_to = min(graph.up_to, cap)
    return e


engines = {"plain_old": engine(False, False), "plain_new": engine(True, False),
           "default_old": engine(False, True), "default_new": engine(True, True)}
if args.twin:
    engines["default_old2"] = engine(False, True)
capped = f"default_new{args.capped}" if args.capped else None
if capped:
    engines[capped] = engine(True, True, cap=args.capped)
METHODS = [m for m in ["plain_old", "plain_new", "default_old", "default_new", "hf"] + (["default_old2"] if args.twin else []) + ([capped] if capped else [])
           if m not in args.skip.split(",")]
stock = Engine(stock_twin(engines["plain_old"].target, T, engines["plain_old"].target.dtype)) if "hf" in METHODS else None
tok = engines["plain_old"].tokenizer
jobs = [("mt_bench", engines["plain_old"].encode(t, chat=True)) for t in timed]
for w in filter(None, args.workloads.split(",")):
    jobs += [(w, encode(tok, q, [])) for q in load_workload(w, args.per_workload, tok, "../shared/data")]


def run(method, ids):
    import time
    if method == "hf":
        t = time.perf_counter()
        tokens = hf_generate(stock, ids, args.max_new_tokens)
        return {"tok_s": len(tokens) / (time.perf_counter() - t), "steps": 0, "accepted": 0, "tokens": tokens}
    r = engines[method].generate(ids, max_new_tokens=args.max_new_tokens, speculative=not method.startswith("plain"))
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "tokens": r.token_ids,
            "plain_steps": s.target_forwards - 1, "copied_steps": s.copied_steps}


primed_run(METHODS, run, jobs, lambda: [engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens)
                                            for prompt in priming for m, engine in engines.items()
                                            if m.startswith("default")])
rows = rotated_rows(jobs, METHODS, run, identical_to(METHODS, "plain_old"))
for r in rows:
    r["plain"] = r["plain_old"]  # workload_summary's baseline: the plain loop on the one oneDNN graph
summary = workload_summary(rows, METHODS, ["mt_bench"] + [w for w in args.workloads.split(",") if w], "default_old")
env = {**primed_environment(args, engines["plain_old"].target.dtype), "timed": len(jobs), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
