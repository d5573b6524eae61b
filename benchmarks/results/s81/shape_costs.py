"""Session 81: what each draft shape costs a drafter server per round at 1-16 rows, and the break-even tau*(B)
it needs, from the scheduler's own calibration (Scheduler.calibrate: plain and speculative rounds over dummy
sequences, BatchDecoder, the AOT-compiled target and drafter). Prints, per shape and batch size: forward(B, 1),
forward(B, W), drafting(B) in ms and tau*(B). Run from the repo root:

    python benchmarks/results/s81/shape_costs.py --threads 1 [--repeats 3]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from anchorspec.api import load
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.tree import TreeShape
from anchorspec.serve.scheduler import Scheduler

DRAFTER = Path("checkpoints/smollm2-135m-instruct-eagle3.1")
SHAPES = [TreeShape.chain(1), TreeShape.chain(2), TreeShape.chain(3), TreeShape.chain(4), TreeShape(4, 4, 16)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--repeats", type=int, default=2, help="calibrations per shape (the monitor averages them)")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", str(DRAFTER), "auto", threads=args.threads, compile="auto")
    batches = tuple(int(b) for b in args.batches.split(","))
    record = {"dtype": str(engine.target.dtype), "threads": args.threads, "shapes": {}}
    for rep in range(args.repeats + 1):  # the first pass compiles and warms every shape
        for shape in SHAPES:
            monitor = DriftMonitor(smoothing=1.0)
            Scheduler(engine, monitor=monitor, shape=shape, max_running=max(batches), calibrate=False) \
                .calibrate(steps=3, batches=batches)
            if rep == 0:
                continue
            width = monitor.width
            rows = {}
            for b in batches:
                rows[b] = {"plain_ms": 1e3 * monitor.forward(b, 1), "verify_ms": 1e3 * monitor.forward(b, width),
                           "draft_ms": 1e3 * monitor.drafting(b), "tau_star": monitor.threshold_at(b)}
            key = f"{shape.top_k},{shape.depth},{shape.total_tokens}"
            record["shapes"].setdefault(key, []).append({"width": width, "rows": rows})
            print(key, "W", width, " ".join(f"B{b}: {r['plain_ms']:.1f}/{r['verify_ms']:.1f}/{r['draft_ms']:.1f} "
                                              f"t*={r['tau_star']:.2f}" for b, r in rows.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
