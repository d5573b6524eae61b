"""Session 86: SDPA for SmolLM2-135M's heads (9 query heads, 3 key/value heads, 64 dims, bf16) per form, 30 layers'
worth of calls, 1 thread, median of 15: `enable_gqa`, and the query heads of a group laid out as rows of their
key/value head (models/attention.py's group-as-rows, the mask repeated per group), at 16 rows and at 1 row.

    python benchmarks/results/s86/sdpa_forms.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


def bench(fn, n=15):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        for _ in range(30):
            fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


for B, keys, widths in ((16, (90, 300), (1, 2, 4, 8)), (1, (300, 1000), (1, 4, 16, 32))):
    for k in keys:
        for w in widths:
            q = torch.randn(B, 9, w, 64, dtype=torch.bfloat16)
            kk = torch.randn(B, 3, k, 64, dtype=torch.bfloat16)
            v = torch.randn_like(kk)
            m = torch.zeros(B, 1, w, k, dtype=torch.bfloat16)
            gqa = bench(lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=m, enable_gqa=True))
            qf, mf = q.view(B, 3, 3 * w, 64), m.repeat(1, 1, 3, 1)
            rows = bench(lambda: F.scaled_dot_product_attention(qf, kk, v, attn_mask=mf if w > 1 else m))
            print(f"{B} rows, {k} keys, {w} new tokens a row: enable_gqa {gqa:.2f} ms, group as rows {rows:.2f} ms "
                  f"(30 layers)", flush=True)
