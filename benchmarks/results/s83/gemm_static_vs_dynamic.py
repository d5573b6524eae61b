"""Session 83: the step's GEMMs (gemm_only.py's model) through inductor's C++ GEMM template, compiled once with the
row count dynamic (as the AOT step graphs have it) against compiled for each row count, timed in turns within each
repeat (medians of 7 after 2 warm-ups), float32.

    python benchmarks/results/s83/gemm_static_vs_dynamic.py [THREADS]
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as cfg

sys.path.insert(0, str(Path(__file__).parent))
from gemm_only import H, M  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)
model = M().eval()
nbytes = sum(p.numel() for p in model.parameters()) * 4
sizes = (1, 2, 4, 8)
with torch.no_grad(), cfg.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP"):
    static = torch.compile(model, dynamic=False)
    dynamic = torch.compile(model, dynamic=True)
    xs = {n: torch.randn(n, H) for n in sizes}
    for n in sizes:
        torch._dynamo.mark_dynamic(xs[n], 0) if n > 1 else None
        dynamic(xs[n])
    xs_static = {n: torch.randn(n, H) for n in sizes}
    for n in sizes:
        static(xs_static[n])
    times = {(kind, n): [] for kind in ("static", "dynamic") for n in sizes}
    for r in range(9):
        for n in sizes:
            for kind, f, x in (("static", static, xs_static[n]), ("dynamic", dynamic, xs[n])):
                t = time.perf_counter()
                f(x)
                if r >= 2:
                    times[kind, n].append(time.perf_counter() - t)
for n in sizes:
    s, d = (statistics.median(times[k, n]) for k in ("static", "dynamic"))
    print(f"threads {torch.get_num_threads()}, {n} rows: compiled for it {s * 1e3:.1f} ms ({nbytes / s / 1e9:.1f} GB/s), "
          f"row count dynamic {d * 1e3:.1f} ms ({d / s:.2f}x)", flush=True)
