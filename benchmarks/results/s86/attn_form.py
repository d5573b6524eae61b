"""Session 86: the step graph's attention form at sixteen users. Grouped-query attention runs in the graph in one form
for every row count (models/attention.py: graph_form, from a one-row probe): on this AMX host the probe picks
`enable_gqa`, which at 16 rows and 2-8 new tokens a row took twice as long as the query heads laid out as rows of their
key/value head. This loads the target and drafter twice in one process, graphs compiled in each form (the second by
presetting the one-row verdict to "rows"), and runs s86/round_ledger.py's workload (4 users' warm-up, then 32 requests
at 16 in flight, MT-bench first turns, T=0, 128 tokens, 1 thread) on plain and drafter schedulers of each, in
alternating order per block. Prints each run's total tokens/s over the gqa-form plain scheduler's.

    python benchmarks/results/s86/attn_form.py --blocks 3 --threads 1
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import round_ledger  # noqa: E402
from anchorspec.api import Engine, load  # noqa: E402
from anchorspec.models import attention  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for form in ("enable_gqa", "rows"):
        memo = ("cpu", torch.bfloat16, 3, 3, 64, args.threads)  # SmolLM2-135M's and its drafter's heads
        attention._one_row_form[memo] = form
        engine = load("smollm2-135m-instruct", round_ledger.DRAFTER, "auto", threads=args.threads, compile=True)
        engine.target.load_graph()
        engine.drafter.load_graph()
        print(f"{form}: target graph {engine.target.aot_path().name}", flush=True)
        engines[form] = (engine, Engine(engine.target))
    attention._one_row_form.pop(("cpu", torch.bfloat16, 3, 3, 64, args.threads))
    turns = [json.loads(line)["turns"][0] for line in round_ledger.DATA.read_text().splitlines()]
    enc = [engines["rows"][0].encode_chat([{"role": "user", "content": t}]) for t in turns]
    names = [(form, kind) for form in engines for kind in ("plain", "drafter")]
    for form, kind in names:  # warm every path once
        engine, plain = engines[form]
        round_ledger.run(plain if kind == "plain" else engine, [], enc[-4:], kind == "drafter", 32)
    ratios = {name: [] for name in names}
    for block in range(args.blocks):
        start = block * (args.requests + args.warm)
        warm = [enc[(start + i) % len(enc)] for i in range(args.warm)]
        prompts = [enc[(start + args.warm + i) % len(enc)] for i in range(args.requests)]
        speed = {}
        for form, kind in (names if block % 2 == 0 else names[::-1]):
            engine, plain = engines[form]
            wall, rounds, _ = round_ledger.run(plain if kind == "plain" else engine, warm, prompts, kind == "drafter",
                                               args.max_tokens)
            speed[form, kind] = sum(r["tokens"] for r in rounds) / wall
        base = speed["enable_gqa", "plain"]
        for name in names:
            ratios[name].append(speed[name] / base)
        print(f"block {block}: " + ", ".join(f"{f} {k} {speed[f, k]:.1f} tok/s ({speed[f, k] / base:.3f}x)"
                                             for f, k in names), flush=True)
    for name, r in ratios.items():
        print(f"{name[0]} {name[1]}: median {statistics.median(r):.3f}x the gqa-form plain server ("
              + ", ".join(f"{x:.3f}" for x in r) + ")")


if __name__ == "__main__":
    main()
