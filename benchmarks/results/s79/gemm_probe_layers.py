"""Session 79: the target's layer GEMMs (30 layers x q/k/v, o, gate/up, down of SmolLM2-135M, distinct weights, bf16) through
eager F.linear, oneDNN prepacked, int8 weight-only and inductor (freezing; max_autotune with the C++ GEMM template), at M rows.

    python benchmarks/results/s79/gemm_probe_layers.py THREADS M
"""
import torch, time, sys, statistics
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from anchorspec.models.packed import pack_weight, packed_linear
M = int(sys.argv[2]) if len(sys.argv) > 2 else 1
L = 30
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
dt = torch.bfloat16
torch.manual_seed(0)
Ws = [[torch.randn(n, k, dtype=dt) * 0.02 for (n, k) in shapes] for _ in range(L)]
nbytes = sum(w.numel() * 2 for ws in Ws for w in ws)
xs = {k: torch.randn(M, k, dtype=dt) for (_, k) in shapes}
def timeit(f, reps=15):
    f(); f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
def run_eager():
    for ws in Ws:
        for w in ws: torch.nn.functional.linear(xs[w.shape[1]], w)
P = [[pack_weight(w) for w in ws] for ws in Ws]
def run_packed():
    for ps, ws in zip(P, Ws):
        for p, w in zip(ps, ws): packed_linear(xs[w.shape[1]], p, None, w.shape[0])
Q = []
for ws in Ws:
    row = []
    for w in ws:
        s = w.float().abs().amax(1) / 127
        row.append((torch.round(w.float() / s[:, None]).to(torch.int8), s.to(dt)))
    Q.append(row)
def run_int8():
    for qs in Q:
        for q, s in qs: torch._weight_int8pack_mm(xs[q.shape[1]], q, s)
class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ls = torch.nn.ModuleList()
        for ws in Ws:
            for w in ws:
                l = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dt); l.weight.data = w; self.ls.append(l)
    def forward(self, a, b):
        outs = []
        for l in self.ls:
            outs.append(l(a if l.in_features == 576 else b))
        return outs
res = {}
res['eager'] = timeit(run_eager)
res['packed'] = timeit(run_packed)
res['int8pack(bytes/2)'] = timeit(run_int8)
import torch._inductor.config as ic
mod = Stack().eval()
a, b = xs[576], xs[1536]
for name, cfg in [('inductor freezing', dict(freezing=True)),
                  ('inductor max_autotune CPP', dict(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"))]:
    try:
        torch._dynamo.reset()
        with torch.no_grad(), ic.patch(**cfg):
            c = torch.compile(mod)
            t0 = time.perf_counter(); c(a, b); ct = time.perf_counter() - t0
            res[name] = timeit(lambda: c(a, b))
            print(name, 'compile s', round(ct, 1), flush=True)
    except Exception as e:
        print(name, 'failed', repr(e)[:300])
for k, v in res.items():
    print(f"{k:28s} M={M} {v*1e3:7.2f} ms  {nbytes/v/1e9:6.1f} GB/s(weights)")
