#!/usr/bin/env python
"""Does the drafter accept as well right after a plain stretch (its catch-up on the stretch's features) as
without switches? Round 17, float32, 2 threads, 96 new tokens, MT-bench first turns 81, 91, 101, 111: one
run without the fallback, one switching off after every speculative step and retrying after 3 plain
tokens. Outputs must be identical; a broken catch-up would show as tau near 1. Session 41 output:
catchup_check.txt."""
import json

import torch

from anchorspec.api import load
from anchorspec.decode.engine import GenerationConfig, generate_speculative
from anchorspec.decode.fallback import StreamMonitor
from anchorspec.decode.tree import TreeShape

torch.set_num_threads(2)
eng = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="float32", threads=2, remember=False)
qs = [json.loads(l) for l in open("../shared/data/mt_bench/question.jsonl")][:40:10]
for shape in (TreeShape(4, 4, 16), TreeShape.chain(3)):
    for q in qs:
        ids = eng.encode(q["turns"][0], chat=True)
        cfg = GenerationConfig(max_new_tokens=96, stop_token_ids=eng.stop_token_ids())
        free = generate_speculative(eng.target, eng.proposer, ids, cfg, shape)
        mon = StreamMonitor(window=1, min_steps=1, retry_after=3, max_retry_after=3, threshold=100.0)
        mon.calibrated = True
        sw = generate_speculative(eng.target, eng.proposer, ids, cfg, shape, fallback=mon)
        assert sw.token_ids == free.token_ids
        print(q["question_id"], shape.depth, "free tau %.2f" % free.stats.tau, "after catch-up tau %.2f" % sw.stats.tau, sw.stats.verify_steps, sw.stats.fallback_switches)
