#!/usr/bin/env python
"""What Eagle3Drafter.compile() saves per draft: a chain drafted after one new position (as the
fallback's calibration times a draft, decode/fallback.py), eager against compiled, on the real target.

    python benchmarks/bench_drafter_compile.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 --dtype bfloat16

Prints the median milliseconds per draft for each chain depth (after a warm-up that compiles).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from anchorspec.api import attach_drafter
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target, parse_dtype


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=300, help="positions the drafter has read before timing")
    p.add_argument("--depths", default="1,2,4,6")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype, pack="off")
    eager = load_drafter(args.drafter, dtype)
    attach_drafter(target, eager)
    compiled = copy.copy(eager)  # shares the weights; only the twin is compiled
    compiled.compile()
    ctx, warm = args.context, 5
    depths = [int(d) for d in args.depths.split(",")]
    ids = torch.arange(ctx + len(depths) * (warm + args.repeats) + 2) % 5000 + 100
    aux = target.forward(ids[:-1], torch.arange(ids.numel() - 1), target.new_cache(), capture_aux=True).aux
    print(f"{args.dtype}, {args.threads} thread(s), context {ctx}: ms per chain draft, median of {args.repeats}")
    for depth in depths:
        row = []
        for name, drafter in (("eager", eager), ("compiled", compiled)):
            proposer = EagleProposer(drafter)
            proposer.update(ids[:ctx], aux[:ctx - 1])
            fed, samples = ctx - 1, []
            with torch.inference_mode():
                for _ in range(warm + args.repeats):
                    t0 = time.perf_counter()
                    proposer.update(ids[:fed + 2], aux[fed:fed + 1])
                    proposer.propose(TreeShape.chain(depth), SamplingParams(), None)
                    samples.append(time.perf_counter() - t0)
                    fed += 1
            row.append((name, 1000 * statistics.median(samples[warm:])))
        (_, e), (_, c) = row
        print(f"chain {depth}: eager {e:.2f} ms, compiled {c:.2f} ms ({c / e:.2f}x)", flush=True)
    print(f"drafter graphs compiled: {compiled.compiles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
