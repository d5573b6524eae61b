"""Session 80: prompts prefilled through the AOT step graph (decode/batch.py, GRAPH_PREFILL_TOKENS) against eager
prefills, for the plain loop and `generate`'s defaults (round-24 EAGLE-3.1 release), on MT-bench first turns and
EAGLE's summarisation / QA / HumanEval subsets (chat template, T=0). Each method has its own engine (the twin on);
the drafter engines are primed apart on the same prompts; methods rotate per prompt. `prefill_ms`: the prefill's
seconds as the stats record them (time to the first token).

    python benchmarks/results/s80/graph_prefill.py --limit 16 --per-workload 8 --out FILE.json
"""
import json, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import anchorspec.decode.batch as batch_module  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from bench_core import (identical_to, primed_environment, primed_parser, primed_prompts, primed_run,  # noqa: E402
                        rotated_rows, workload_summary)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--per-workload", type=int, default=8)
p.add_argument("--workloads", default="sum,qa,humaneval")
args = p.parse_args()
timed, priming = primed_prompts(args)
T = "smollm2-135m-instruct"
LIMIT = batch_module.GRAPH_PREFILL_TOKENS


def engine(drafter: bool):
    e = load(T, args.drafter if drafter else None, dtype="auto", threads=args.threads, compile=True, remember=False)
    e.warm_up()
    return e


METHODS = ["plain_eager_prefill", "plain", "default_eager_prefill", "default"]
engines = {m: engine(m.startswith("default")) for m in METHODS}
tok = engines["plain"].tokenizer
jobs = [("mt_bench", engines["plain"].encode(t, chat=True)) for t in timed]
for w in filter(None, args.workloads.split(",")):
    jobs += [(w, encode(tok, q, [])) for q in load_workload(w, args.per_workload, tok, "../shared/data")]


def run(method, ids):
    batch_module.GRAPH_PREFILL_TOKENS = 0 if method.endswith("eager_prefill") else LIMIT
    r = engines[method].generate(ids, max_new_tokens=args.max_new_tokens, speculative=method.startswith("default"))
    s = r.stats
    return {"tok_s": s.tokens_per_s, "prefill_ms": s.prefill_s * 1e3, "steps": s.verify_steps,
            "accepted": s.accepted_tokens, "tokens": r.token_ids, "plain_steps": s.target_forwards - 1,
            "copied_steps": s.copied_steps}


primed_run(METHODS, run, jobs, lambda: [engine.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens)
                                            for prompt in priming for m, engine in engines.items()
                                            if m.startswith("default")])
rows = rotated_rows(jobs, METHODS, run, identical_to(METHODS, "plain_eager_prefill"))
summary = workload_summary(rows, METHODS, ["mt_bench"] + [w for w in args.workloads.split(",") if w],
                           "default_eager_prefill")
env = {**primed_environment(args, engines["plain"].target.dtype), "timed": len(jobs), "priming": len(priming),
       "graph_prefill_tokens": LIMIT}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
