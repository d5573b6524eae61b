"""Session 78: a solo greedy stream skipping the drafter on steps where the context lookup found a long chain (the
copied chain alone is verified), against `generate`'s defaults (the drafter's tree with the chain merged) and
prompt lookup alone, on MT-bench first turns and EAGLE's summarisation / QA / HumanEval subsets (chat template,
T=0). ALONE=n: a step drafts the copied chain alone when the chain found is at least n tokens long (the adaptive
length: 2 after a miss, 4 with no match last step, 2 * accepted + 2 after a chain).

    git apply benchmarks/results/s78/lookup-alone-threshold.patch   # on e8fde8e: the fixed threshold (not kept)
    python benchmarks/results/s78/lookup_alone.py --limit 16 --per-workload 8 --out FILE.json
"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import anchorspec.decode.engine as engine_module  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.bench.workloads import encode, load_workload  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from bench_core import (identical_to, primed_environment, primed_parser, primed_prompts, primed_run,  # noqa: E402
                        rotated_rows, workload_summary)

p = primed_parser(__doc__.split("\n\n")[0])
p.add_argument("--per-workload", type=int, default=8)
p.add_argument("--workloads", default="sum,qa,humaneval")
p.add_argument("--alone", default="4,6,10", help="thresholds to try")
args = p.parse_args()
timed, priming = primed_prompts(args)
ALONE = [int(a) for a in args.alone.split(",")]
METHODS = ["plain", "lookup", "default"] + [f"alone{a}" for a in ALONE]

plain = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
spec = load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
tok = plain.tokenizer
jobs = [("mt_bench", plain.encode(t, chat=True)) for t in timed]
for w in args.workloads.split(","):
    jobs += [(w, encode(tok, q, [])) for q in load_workload(w, args.per_workload, tok, "../shared/data")]


def run(method, ids):
    engine_module._ALONE = int(method[5:]) if method.startswith("alone") else 0
    engine = plain if method in ("plain", "lookup") else spec
    r = engine.generate(ids, max_new_tokens=args.max_new_tokens, speculative=method != "plain",
                        lookup=LookupSettings() if method == "lookup" else "default")
    s = r.stats
    return {"tok_s": s.tokens_per_s, "steps": s.verify_steps, "accepted": s.accepted_tokens, "tokens": r.token_ids,
            "lookup_rows": s.lookup_rows, "lookup_tokens": s.lookup_tokens, "plain_steps": s.target_forwards - 1}


primed_run(METHODS, run, jobs, lambda: [spec.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens) for prompt in priming])
rows = rotated_rows(jobs, METHODS, run, identical_to(METHODS, "plain"))
summary = workload_summary(rows, METHODS, ["mt_bench"] + args.workloads.split(","), "default")
env = {**primed_environment(args, plain.target.dtype), "timed": len(jobs), "priming": len(priming)}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
