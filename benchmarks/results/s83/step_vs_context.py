"""Session 83: the target's compiled narrow-step graph (the one `generate` runs its plain steps and short verifies
through here), one row, against the context it attends over; beside it eager SDPA over the same keys for 30 layers
(9 query heads over 3 key/value heads, 64 wide), to see what attention adds. Contexts take turns within each repeat.

    python benchmarks/results/s83/step_vs_context.py   # after `anchorspec compile` (or the demo) built the graphs
"""
import statistics
import time

import torch
import torch.nn.functional as F
from anchorspec.api import load
eng = load("smollm2-135m-instruct", compile=True, threads=2)
t = eng.target; g = t.load_graph()
pasts = (128, 512, 1024, 2048)
ex = {p: t._aot_example(rows=1, tokens=1, past=p, kept=1, slots=1, capacity=p + 16) for p in pasts}
q = torch.randn(1, 9, 1, 64)
kv = {p: (torch.randn(1, 3, p + 1, 64), torch.randn(1, 3, p + 1, 64), torch.zeros(1, 1, 1, p + 1)) for p in pasts}
def sdpa30(p):
    k, v, m = kv[p]
    for _ in range(30):
        F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
times = {p: [] for p in pasts}; att = {p: [] for p in pasts}
with torch.no_grad():
    for r in range(13):
        for p in pasts:
            s = time.perf_counter(); g.narrow(*ex[p]); d = time.perf_counter() - s
            s = time.perf_counter(); sdpa30(p); e = time.perf_counter() - s
            if r >= 2:
                times[p].append(d); att[p].append(e)
for p in pasts:
    print(f"past {p}: narrow graph 1 row {statistics.median(times[p])*1e3:.1f} ms; eager SDPA x30 layers {statistics.median(att[p])*1e3:.2f} ms")
