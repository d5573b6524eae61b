#!/usr/bin/env python
"""What one step costs on this machine: a plain step and verifies of N tokens after 300 tokens of
context, bf16 and fp32, 2 threads, median of 15 (decode/shape.py: verify_cost), twice per dtype.

    python benchmarks/results/s41/verify_costs.py   # output of session 41: verify_costs.txt
"""
import torch

from anchorspec.api import load
from anchorspec.decode.shape import verify_cost

torch.set_num_threads(2)
for dtype in ("bfloat16", "float32"):
    eng = load("smollm2-135m-instruct", dtype=dtype, threads=2)
    for _ in range(2):
        verify, plain = verify_cost(eng.target, 300, [2, 3, 4, 5, 8, 16], repeats=15)
        print(dtype, f"plain {plain * 1e3:.1f} ms", " ".join(f"{n}:{s * 1e3:.1f}" for n, s in verify.items()), flush=True)
