"""Session 84: the plain step a stream's cost estimates divide by (the monitor's calibration) against the plain loop's
time per token, in one process: where do they differ? bf16 (auto), compiled, 2 threads, MT-bench first turns."""
import json, statistics, time
import torch
from anchorspec.api import load
from anchorspec.decode.shape import verify_cost

torch.set_num_threads(2)
eng = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto", threads=2, remember=False,
           compile=True)
plain = load("smollm2-135m-instruct", None, "auto", threads=2, remember=False, compile=True)
turns = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:6]
m = eng.monitor
m.calibrate(eng.target, eng.proposer)
print(f"calibrated plain step: {1e3 * m.verify(1):.2f} ms (pace {m.pace():.3f})")
for context in (128, 256):
    _, p = verify_cost(eng.target, context, [2, 4], repeats=9)
    _, p2 = verify_cost(plain.target, context, [2, 4], repeats=9)
    print(f"verify_cost plain step at context {context}: drafter engine's target {1e3 * p:.2f} ms, plain engine's {1e3 * p2:.2f} ms")
for t in turns:
    ids = plain.encode(t, chat=True)
    res = plain.generate(ids, max_new_tokens=128, speculative=False)
    s = res.stats
    per = (s.total_s - s.prefill_s) / max(len(res.token_ids) - 1, 1)
    print(f"plain loop: prompt {len(ids)} tokens, {len(res.token_ids)} new, {1e3 * per:.2f} ms a token")
