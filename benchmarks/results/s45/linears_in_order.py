"""All of a one-token step's linear layers, run back to back in the model's order (per layer: q+k+v, o,
gate+up, down; then lm_head), bf16 prepacked (oneDNN, what the packed target runs) and float32, 2 threads.
Unlike s44/gemv_bandwidth.py, which cycled through one shape's 30 weights at a time (a working set of at
most ~106 MB, inside this host's 480 MiB L3 when neighbours leave it room), this touches the whole model's
weights (~270 MB bf16) per token, as a decode step does. The gap between the two is the memory system's,
not the step's code. Also: the same sequence with K weights only (one layer's, L2/L3-resident), to time
the per-call cost without the memory traffic.

    python benchmarks/results/s45/linears_in_order.py"""
import statistics, time
import torch

torch.set_num_threads(2)
H, I, KV, V, L = 576, 1536, 192, 49152, 30
SHAPES = [(H + 2 * KV, H), (H, H), (2 * I, H), (H, I)]


def timed(fn, reps=40, warm=5):
    for _ in range(warm):
        fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


for label, dtype, packed in (("bf16 prepacked", torch.bfloat16, True), ("float32", torch.float32, False)):
    def weight(n, k):
        w = torch.randn(n, k, dtype=dtype) * 0.02
        return torch.ops.mkldnn._reorder_linear_weight(w, 1) if packed else w

    def lin(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") if packed else torch.nn.functional.linear(x, w)

    layers = [[weight(n, k) for n, k in SHAPES] for _ in range(L)]
    head = weight(V, H)
    xs = {k: torch.randn(1, k, dtype=dtype) for k in (H, I)}

    def step(layer_ws):
        for ws in layer_ws:
            for w, (n, k) in zip(ws, SHAPES):
                lin(xs[k], w)
        lin(xs[H], head)

    with torch.inference_mode():
        full = timed(lambda: step(layers))
        one = timed(lambda: step([layers[0]] * L))
        head_only = timed(lambda: lin(xs[H], head), reps=100)
    nbytes = sum(w.numel() for ws in layers for w in [torch.empty(n, k) for n, k in SHAPES]) + V * H
    nbytes *= 2 if dtype == torch.bfloat16 else 4
    print(f"{label:15s} model order, all weights: {full * 1e3:5.1f} ms a token ({nbytes / full / 1e9:4.1f} GB/s of "
          f"{nbytes / 1e6:.0f} MB) | one layer's weights x{L}: {one * 1e3:5.1f} ms | lm_head alone {head_only * 1e3:.2f} ms")
