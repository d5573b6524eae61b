"""How much a fresh machine's calibration (StreamMonitor.calibrate: 3 timed forwards per size) moves the
starting shape, against costs timed long and quietly (verify_cost with 15 repeats). Each trial is a fresh
monitor calibrated in the same process (graphs warm), printing the relative step cost (draft + verify over
a plain step, with and without `at_least`) of chains 3-4 and EAGLE's 4,4,16 tree, and the shape chosen on
the prior acceptance. Session 48.

    python benchmarks/results/s48/calibration_noise.py [TRIALS]"""
import statistics
import sys

import torch

from anchorspec.api import load
from anchorspec.decode.fallback import StreamMonitor, shape_key
from anchorspec.decode.shape import verify_cost
from anchorspec.decode.tree import TreeShape

trials = int(sys.argv[1]) if len(sys.argv) > 1 else 8
eng = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", threads=2, compile=True,
           remember=False)
eng.warm_up()
shapes = [TreeShape.chain(3), TreeShape.chain(4), TreeShape(4, 4, 16)]
verify, plain = verify_cost(eng.target, 128, [4, 5, 16], repeats=15)
print(f"quiet costs (15 repeats): plain {plain*1e3:.1f} ms, verify(4) {verify[4]*1e3:.1f}, "
      f"verify(5) {verify[5]*1e3:.1f}, verify(16) {verify[16]*1e3:.1f}", flush=True)
rows = []
for i in range(trials):
    m = StreamMonitor()
    m.calibrate(eng.target, eng.proposer)
    p = m.verify(1)
    parts = []
    for s in shapes:
        raw = (m.draft_cost(s) + m.verify(s.total_tokens)) / p
        parts.append(f"{shape_key(s)} cost {m.relative_step_cost(s):.2f} (raw {raw:.2f}) speedup {m.speedup(s):.2f}")
    best, speed = m.choose_shape()
    rows.append(shape_key(best))
    print(f"trial {i}: plain {p*1e3:.1f} ms; " + "; ".join(parts) + f"; chose {shape_key(best)} ({speed:.2f}x)", flush=True)
print("chosen:", {k: rows.count(k) for k in sorted(set(rows))})
