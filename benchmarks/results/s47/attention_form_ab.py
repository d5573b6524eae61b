"""Grouped attention inside the AOT step graphs: group-as-rows (session 47's graph_form on this host) against
enable_gqa (every graph before it), two engines in one process, methods alternating per prompt and round.
Plain loop, and the EAGLE-3.1 release with a fixed chain of 3 and EAGLE's 4,4,16 tree (fallback off), bf16.

    python benchmarks/results/s47/attention_form_ab.py [--prompts 6] [--rounds 2]"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_core import load_prompts  # noqa: E402

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.models import attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=6)
ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(2)
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"
engines = {}
for form in (attention.ROWS, attention.GQA):
    for memo in [m for m in attention._one_row_form if m[1] == torch.bfloat16]:
        del attention._one_row_form[memo]
    memo = ("cpu", torch.bfloat16, 3, 3, 64, 2)
    attention._one_row_form[memo] = form  # what graph_form reads, and the traced body too
    engines[form] = load("smollm2-135m-instruct", DRAFTER, "bfloat16", threads=2, compile=True, remember=False,
                         fallback=False)
prompts = load_prompts(str(Path(__file__).resolve().parents[4] / "shared/data/mt_bench/question.jsonl"),
                       args.prompts, 13)
methods = {"plain": {"speculative": False}, "chain 3": {"shape": TreeShape.chain(3)},
           "tree 4,4,16": {"shape": TreeShape(4, 4, 16)}}
rates = {(f, m): [] for f in engines for m in methods}
for r in range(args.rounds):
    for i, p in enumerate(prompts):
        ids = engines[attention.ROWS].encode(p["text"], chat=True)
        order = list(engines) if (i + r) % 2 == 0 else list(engines)[::-1]
        for m, kw in methods.items():
            for f in order:
                t0 = time.perf_counter()
                res = engines[f].generate(ids, max_new_tokens=128, **kw)
                rates[f, m].append(len(res.token_ids) / (time.perf_counter() - t0))
print(f"{len(prompts)} MT-bench prompts x {args.rounds} rounds, 128 new tokens, bf16, 2 threads, AOT graphs")
for m in methods:
    rows, gqa = rates[attention.ROWS, m], rates[attention.GQA, m]
    ratio = statistics.median(a / b for a, b in zip(rows, gqa))
    print(f"{m:12s} rows {statistics.median(rows):6.1f} tok/s   enable_gqa {statistics.median(gqa):6.1f} tok/s"
          f"   per-run ratio median {ratio:.3f}")
