"""Session 83: only a step's GEMMs (SmolLM2-135M's shapes: 30 layers of fused q/k/v, o, fused gate/up and down, then
the LM head; 538 MB of float32 weights, random), compiled as the step graphs are (frozen; the narrow graph's C++ GEMM
template, or oneDNN as the wide graph), at 1-8 rows: how close to the read bandwidth the GEMMs alone get.
`cppdyn`: the template with the row count dynamic (as an AOT step graph has it).

    python benchmarks/results/s83/gemm_only.py cpp|cppdyn|onednn [THREADS]
"""
import torch, time, statistics, sys
import torch._inductor.config as cfg
H, I, KV, L, V = 576, 1536, 192, 30, 49152
class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.q = torch.nn.ModuleList(torch.nn.Linear(H, H + 2 * KV, bias=False) for _ in range(L))
        s.o = torch.nn.ModuleList(torch.nn.Linear(H, H, bias=False) for _ in range(L))
        s.gu = torch.nn.ModuleList(torch.nn.Linear(H, 2 * I, bias=False) for _ in range(L))
        s.d = torch.nn.ModuleList(torch.nn.Linear(I, H, bias=False) for _ in range(L))
        s.head = torch.nn.Linear(H, V, bias=False)
    def forward(s, x):
        for l in range(L):
            a = s.q[l](x)[:, :H]
            x = x + s.o[l](a)
            g, u = s.gu[l](x).chunk(2, -1)
            x = x + s.d[l](torch.nn.functional.silu(g) * u)
        return s.head(x)
def main():
    torch.manual_seed(0)
    m = M().eval()
    nbytes = sum(p.numel() for p in m.parameters()) * 4
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    mode = sys.argv[1]
    opts = dict(freezing=True) if mode.startswith("onednn") else dict(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP")
    with torch.no_grad(), cfg.patch(**opts):
        f = torch.compile(m, dynamic=mode.endswith("dyn"))
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, H)
            if mode.endswith("dyn"):
                torch._dynamo.maybe_mark_dynamic(x, 0)
            f(x)
            ts = []
            for r in range(9):
                s = time.perf_counter(); f(x); ts.append(time.perf_counter() - s)
            med = statistics.median(ts[2:])
            print(f"{mode} threads {torch.get_num_threads()} rows {rows}: {med*1e3:.1f} ms, {nbytes/med/1e9:.1f} GB/s ({nbytes/1e6:.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
