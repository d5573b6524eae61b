"""Session 87: SDPA alone in its two grouped-query forms (enable_gqa; query heads of a group as rows of their key/value
head, the mask repeated) at SmolLM2-135M's heads (9 query, 3 key/value, 64), 1 thread, causal additive masks, bf16 and
float32; the fastest of 3 medians of 15 calls. Imports the two forms from cond_toy.py. Output: sdpa-shapes.log."""
import time, torch
from cond_toy import rows, gqa
torch.set_num_threads(1)
for dt in (torch.bfloat16, torch.float32):
  for B, T, L in ((1, 128, 128), (1, 512, 512), (4, 64, 300), (16, 2, 150), (1, 4, 256), (4, 4, 256), (16, 1, 150)):
    q = torch.randn(B, 9, T, 64, dtype=dt); k = torch.randn(B, 3, L, 64, dtype=dt); v = torch.randn(B, 3, L, 64, dtype=dt)
    m = torch.zeros(B, 1, T, L, dtype=dt)
    m[..., :, :] = torch.triu(torch.full((T, L), float("-inf"), dtype=dt), diagonal=L - T + 1)
    res = {}
    for rep in range(3):
        for name, fn in (("gqa", gqa), ("rows", rows)):
            ts = []
            for _ in range(15):
                t = time.perf_counter(); fn(q, k, v, m); ts.append(time.perf_counter() - t)
            res.setdefault(name, []).append(sorted(ts)[7] * 1e6)
    g, r = min(res["gqa"]), min(res["rows"])
    print(f"{str(dt)[6:]:9s} B{B:2d} T{T:3d} L{L:3d}: gqa {g:8.0f} us, rows {r:8.0f} us  rows/gqa {r/g:.2f}")
