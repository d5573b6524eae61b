"""Issue 15's decoding options against `generate`'s defaults with the round-24 release (session 72).

Each method has its own compiled engine and monitor (remember=False: every one starts as a fresh machine
does), methods rotated per prompt in one process; T=0 then T=1 (seed = prompt index). Prints per method the
median tokens/s, the median and range of its per-prompt speed over the plain loop at the same temperature,
and tau over all steps.

    python benchmarks/results/s72/options_r24.py --every 3 --limit 27 --threads 2 --out FILE.json
"""
import argparse, json, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from anchorspec import load  # noqa: E402
from bench_core import in_turns, load_prompts, warn_if_busy  # noqa: E402
from anchorspec.models.dtype import cpu_description  # noqa: E402

METHODS = {"default": {}, "staged1": {"staged": 1}, "drift": {"prune": "drift"}, "pid": {"depth_control": "pid"}}

p = argparse.ArgumentParser()
p.add_argument("--drafter", default="checkpoints/smollm2-135m-instruct-eagle3.1")
p.add_argument("--data", default="../shared/data/mt_bench/question.jsonl")
p.add_argument("--every", type=int, default=3)
p.add_argument("--limit", type=int, default=27)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
warn_if_busy(args.threads)
prompts = [q["text"] for q in load_prompts(args.data, args.limit, args.every)]
plain_engine = load("smollm2-135m-instruct", threads=args.threads, compile=True, remember=False)
engines = {m: load("smollm2-135m-instruct", args.drafter, threads=args.threads, compile=True, remember=False)
           for m in METHODS}
for e in [plain_engine, *engines.values()]:
    for t in (0.0, 1.0):
        e.generate("Hello", chat=True, max_new_tokens=8, temperature=t, seed=0)
rows = []
for temperature in (0.0, 1.0):
    for i, prompt in enumerate(prompts):
        row = {"prompt": i, "temperature": temperature}
        for m in in_turns(["plain", *METHODS], i):
            eng = plain_engine if m == "plain" else engines[m]
            kw = {} if m == "plain" else METHODS[m]
            r = eng.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=i,
                             speculative=m != "plain", **kw)
            row[m] = {"tok_s": r.stats.tokens_per_s, "steps": r.stats.verify_steps, "accepted": r.stats.accepted_tokens,
                      "new": r.stats.new_tokens}
        rows.append(row)
        print(json.dumps(row), flush=True)
summary = {}
for temperature in (0.0, 1.0):
    rs = [r for r in rows if r["temperature"] == temperature]
    for m in ["plain", *METHODS]:
        ratios = [r[m]["tok_s"] / r["plain"]["tok_s"] for r in rs]
        steps = sum(r[m]["steps"] for r in rs)
        tau = (sum(r[m]["accepted"] for r in rs) + steps) / steps if steps else None
        summary[f"T={temperature:g} {m}"] = {"median_tok_s": statistics.median(r[m]["tok_s"] for r in rs),
                                             "median_vs_plain": statistics.median(ratios), "min_vs_plain": min(ratios),
                                             "max_vs_plain": max(ratios), "tau": tau}
        s = summary[f"T={temperature:g} {m}"]
        print(f"T={temperature:g} {m:8s} {s['median_tok_s']:6.1f} tok/s  {s['median_vs_plain']:.2f}x plain "
              f"({s['min_vs_plain']:.2f}-{s['max_vs_plain']:.2f})  tau {tau if tau is None else round(tau, 2)}")
cpu = cpu_description()
env = {"cpu": cpu["model"], "flags": [f for f in cpu["flags"] if "avx512" in f or "amx" in f or f == "avx2"],
       "torch": torch.__version__, "threads": args.threads, "dtype": str(plain_engine.target.dtype),
       "drafter": args.drafter, "prompts": len(prompts), "every": args.every, "max_new_tokens": args.max_new_tokens}
Path(args.out).write_text(json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1) + "\n")
