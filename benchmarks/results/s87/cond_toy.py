"""Session 87: both grouped-attention forms as torch.cond branches on the query length T in one exported graph (a toy:
a linear layer, then 30 attention calls, bf16, 1 thread), compiled with AOTInductor and checked against eager at
T = 1, 2, 4: exact. cond_toy_forms.py times it against graphs of one form. (In SmolLM2-135M's step graph the same
construction computed wrong logits at T >= 2: graph_logits.py; not kept.)"""
import time, torch, torch.nn.functional as F
from torch.export import Dim
torch.set_num_threads(1)

def rows(q, k, v, m):
    B, H, T, D = q.shape
    g = H // k.shape[1]
    r = q.contiguous().view(B, k.shape[1], g * T, D)
    mm = m.repeat(1, 1, g, 1)
    o = F.scaled_dot_product_attention(r, k, v, attn_mask=mm)
    return o.unflatten(2, (g, T)).flatten(1, 2)

def gqa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.lin = torch.nn.Linear(64, 64)
    def forward(self, q, k, v, m):
        q = self.lin(q)
        for _ in range(30):
            q = torch.cond(q.shape[2] == 1, gqa, rows, (q, k, v, m))
        return q

if True:
    pass
B, T, L = Dim("B", min=1), Dim("T", min=1), Dim("L", min=2)
ex = (torch.randn(2, 9, 3, 64), torch.randn(2, 3, 7, 64), torch.randn(2, 3, 7, 64), torch.zeros(2, 1, 3, 7))
ex = tuple(x.bfloat16() for x in ex)
if __name__ == "__main__":
    m = M().bfloat16()
    ep = torch.export.export(m, ex, dynamic_shapes=({0: B, 2: T}, {0: B, 2: L}, {0: B, 2: L}, {0: B, 2: T, 3: L}))
    print(ep.graph_module.code[:1500])
    t = time.time()
    path = torch._inductor.aoti_compile_and_package(ep, package_path="/tmp/m.pt2")
    print("compiled", time.time() - t)
    runner = torch._inductor.aoti_load_package(path)
    for T_ in (1, 2, 4):
        args = (torch.randn(16, 9, T_, 64), torch.randn(16, 3, 300, 64), torch.randn(16, 3, 300, 64), torch.zeros(16, 1, T_, 300))
        args = tuple(x.bfloat16() for x in args)
        ref = m(*args)
        out = runner(*args)
        ts = []
        for _ in range(10):
            t = time.perf_counter(); runner(*args); ts.append(time.perf_counter() - t)
        print(T_, (out - ref).abs().max().item(), sorted(ts)[5] * 1e3, "ms")
