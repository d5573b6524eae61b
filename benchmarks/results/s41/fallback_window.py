#!/usr/bin/env python
"""The single-stream fallback's min_steps (drafts seen before a switch-off), measured: round 17 and a
random drafter with the default (4) and 8, against the plain loop, on 16 MT-bench first turns
(--every 5, from the OFFSET-th), bf16, 2 threads, methods rotated per prompt in one process, costs
calibrated fresh by a 16-token warm-up generation per engine (untimed).

    python benchmarks/results/s41/fallback_window.py RANDOM_DRAFTER_DIR [OFFSET]   # output: fallback_window.txt
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.fallback import StreamMonitor  # noqa: E402

torch.set_num_threads(2)
release = "checkpoints/smollm2-135m-instruct-eagle3.1"
engines = {}
plain = load("smollm2-135m-instruct", None, "bfloat16", threads=2, remember=False)
for name, drafter in (("r17", release), ("random", sys.argv[1])):
    for min_steps in (4, 8):
        eng = load("smollm2-135m-instruct", drafter, "bfloat16", threads=2, remember=False)
        eng.monitor = StreamMonitor(min_steps=min_steps)
        engines[f"{name} min_steps={min_steps}"] = eng
prompts = load_prompts(DEFAULT_DATA, 16, 5, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
warm = plain.encode(prompts[0]["text"], chat=True)
for eng in [plain, *engines.values()]:
    eng.generate(warm, max_new_tokens=16, speculative=eng is not plain)
rows = {n: [] for n in ["plain", *engines]}
for i, p in enumerate(prompts):
    ids = plain.encode(p["text"], chat=True)
    names = list(rows)
    for n in names[i % len(names):] + names[:i % len(names)]:
        eng = plain if n == "plain" else engines[n]
        t = time.perf_counter()
        res = eng.generate(ids, max_new_tokens=128, speculative=n != "plain")
        rows[n].append((len(res.token_ids) / (time.perf_counter() - t), res.stats.tau, res.stats.fallback_switches))
for n, rs in rows.items():
    ratios = [r[0] / b[0] for r, b in zip(rs, rows["plain"])]
    taus = [r[1] for r in rs if r[1]]
    print(f"{n:22s} vs plain median {statistics.median(ratios):.2f}x mean {statistics.fmean(ratios):.2f}x "
          f"slowest {min(ratios):.2f}x; tau {statistics.fmean(taus) if taus else 0:.2f}; switches {sum(r[2] for r in rs)}",
          flush=True)
