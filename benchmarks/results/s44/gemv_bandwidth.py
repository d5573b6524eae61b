"""Where a one-token step's time goes on this host: every linear layer of SmolLM2-135M at batch 1 (one row),
timed in float32, bf16 and bf16 through oneDNN's prepacked kernel (torch.ops.mkldnn._linear_pointwise,
what the project's packed target runs), against the weight bytes it reads: the achieved GB/s beside a
large copy's (the memory floor). Each call takes the next of the model's distinct weights of that shape
(30 layers: 1 for lm_head), cycling, so weights stream from memory as in a decode step (the caches hold
one layer, not 30). Median of 300 calls after 30 warm-ups; torch threads as given.

    python benchmarks/results/s44/gemv_bandwidth.py --threads 2"""
import argparse, statistics, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
H, I, KV, V, L = 576, 1536, 192, 49152, 30  # SmolLM2-135M: hidden, MLP, k/v width, vocab, layers
# per layer: q+k+v packed, o, gate+up packed, down; once: lm_head (tied embedding)
SHAPES = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}
COUNT = {"qkv": L, "o": L, "gate_up": L, "down": L, "lm_head": 1}


def timed(fn, reps=300, warm=30):
    for _ in range(warm):
        fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


big = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MB: far beyond the caches
dst = torch.empty_like(big)
copy_s = timed(lambda: dst.copy_(big), reps=20, warm=3)
floor_gbs = 2 * big.numel() * 4 / copy_s / 1e9  # read + write
print(f"threads {args.threads}; copy of 256 MB: {floor_gbs:.1f} GB/s (read + write)")
per_token = {}
for name, (n, k) in SHAPES.items():
    row = []
    for label, dtype, packed in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                 ("bf16 prepacked", torch.bfloat16, True)):
        ws = [torch.randn(n, k, dtype=dtype) * 0.02 for _ in range(COUNT[name])]
        w = ws[0]
        x = torch.randn(1, k, dtype=dtype)
        turn = iter(range(10**9))
        if packed:
            pws = [torch.ops.mkldnn._reorder_linear_weight(v, 1) for v in ws]
            fn = lambda: torch.ops.mkldnn._linear_pointwise(x, pws[next(turn) % len(pws)], None, "none", [], "")  # noqa: E731
        else:
            fn = lambda: torch.nn.functional.linear(x, ws[next(turn) % len(ws)])  # noqa: E731
        with torch.inference_mode():
            s = timed(fn)
        gbs = w.numel() * w.element_size() / s / 1e9
        per_token[label] = per_token.get(label, 0.0) + s * COUNT[name]
        row.append(f"{label} {s * 1e6:7.1f} us {gbs:5.1f} GB/s")
    print(f"{name:8s} {n:5d}x{k:<5d} x{COUNT[name]:<3d} " + " | ".join(row))
for label, s in per_token.items():
    print(f"all linears of one token, {label}: {s * 1e3:.1f} ms (at most {1 / s:.0f} tok/s)")
