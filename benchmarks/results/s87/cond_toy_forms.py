"""Session 87: the cond graph of cond_toy.py against graphs of one form each (ms per call of 30 layers, 16 rows, 300
keys, bf16, 1 thread; the fastest of 3 medians): cond-toy.log."""
import time, torch
from torch.export import Dim
from cond_toy import rows, gqa, M, ex, B, T, L
torch.set_num_threads(1)
class P(M):
    def __init__(self, fn):
        super().__init__(); self.fn = fn
    def forward(self, q, k, v, m):
        q = self.lin(q)
        for _ in range(30):
            q = self.fn(q, k, v, m)
        return q
res = {}
runners = {}
for name, fn in (("gqa", gqa), ("rows", rows)):
    m = P(fn).bfloat16()
    ep = torch.export.export(m, ex, dynamic_shapes=({0: B, 2: T}, {0: B, 2: L}, {0: B, 2: L}, {0: B, 2: T, 3: L}))
    runners[name] = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=f"/tmp/{name}.pt2"))
runners["cond"] = torch._inductor.aoti_load_package("/tmp/m.pt2")
for T_ in (1, 2, 4):
    args = (torch.randn(16, 9, T_, 64), torch.randn(16, 3, 300, 64), torch.randn(16, 3, 300, 64), torch.zeros(16, 1, T_, 300))
    args = tuple(x.bfloat16() for x in args)
    out = {}
    for rep in range(3):
        for name, r in runners.items():
            ts = []
            for _ in range(10):
                t = time.perf_counter(); r(*args); ts.append(time.perf_counter() - t)
            out.setdefault(name, []).append(sorted(ts)[5] * 1e3)
    print(T_, {k: round(min(v), 2) for k, v in out.items()})
