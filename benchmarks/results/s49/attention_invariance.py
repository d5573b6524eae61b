"""Why bfloat16 speculative output parts from plain output (session 49): does a verify forward's attention
give each query row the bits a plain one-token step gives it at the same position?

Plain step at position p: one query row over keys 0..p (anchorspec's grouped_attention, no mask). Verify of
T rows from position `base`: T query rows over keys 0..base+T-1 with a causal boolean mask. Row t of the
verify should equal the plain step at base+t. Counted for SDPA (what decoding runs) with the key length as
is or padded up to a multiple of PAD (masked), and for a math form (bf16 matmuls, fp32 softmax) as
transformers' eager attention computes it; then the time per call of SDPA and the math form.
SmolLM2-135M's attention shapes (3 key/value heads x 3 groups x 64), random bf16 tensors.

    python benchmarks/results/s49/attention_invariance.py [THREADS]
"""
import sys
import time

import torch

from anchorspec.models.attention import grouped_attention

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)
KV, GROUPS, D, SCALE = 3, 3, 64, 0.125
keys, values = torch.randn(1, KV, 1100, D).bfloat16(), torch.randn(1, KV, 1100, D).bfloat16()
queries = torch.randn(1, 40, KV * GROUPS, D).bfloat16().transpose(1, 2)  # strided, as the model's are


def math_attention(q, k, v, allowed):
    """transformers' eager attention, group-as-rows: bf16 score GEMM, fp32 softmax, bf16 P @ V."""
    B, H, T, _ = q.shape
    rows = q.contiguous().view(B, KV, GROUPS * T, D)
    s = torch.matmul(rows, k.transpose(-1, -2)).float() * SCALE
    if allowed is not None:
        s = s.masked_fill(~allowed.repeat(1, 1, GROUPS, 1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1).to(q.dtype), v).unflatten(2, (GROUPS, T)).flatten(1, 2)


def sdpa(q, k, v, allowed):
    return grouped_attention(q, k, v, allowed, SCALE)


def allowed_for(T, base, L):
    m = torch.zeros(1, 1, T, L, dtype=torch.bool)
    for t in range(T):
        m[..., t, :base + t + 1] = True
    return m


def mismatches(attend, pad):
    def padded(n):
        return -(-n // pad) * pad if pad else n

    bad = total = 0
    for base in range(20, 1000, 23):
        for T in (2, 3, 4, 5, 8, 16):
            L = padded(base + T)
            out = attend(queries[:, :, :T], keys[:, :, :L], values[:, :, :L], allowed_for(T, base, L))
            for t in range(T):
                p = base + t
                Lp = padded(p + 1)
                mask = allowed_for(1, p, Lp) if Lp != p + 1 else None
                ref = attend(queries[:, :, t:t + 1], keys[:, :, :Lp], values[:, :, :Lp], mask)
                total += 1
                bad += not torch.equal(out[:, :, t:t + 1], ref)
    return bad, total


def micros(fn, n=300):
    for _ in range(30):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e6


with torch.inference_mode():
    print(f"threads {torch.get_num_threads()}, bf16")
    for name, attend, pad in (("sdpa", sdpa, 0), ("sdpa, keys padded to 16", sdpa, 16),
                              ("sdpa, keys padded to 64", sdpa, 64), ("math", math_attention, 0)):
        bad, total = mismatches(attend, pad)
        print(f"{name:26s} verify rows differing from the plain step: {bad} of {total} ({100 * bad / total:.1f} %)")
    for T, L in ((1, 150), (1, 400), (1, 900), (4, 150), (4, 400), (16, 400)):
        q, k, v = queries[:, :, :T], keys[:, :, :L], values[:, :, :L]
        allowed = allowed_for(T, L - T, L) if T > 1 else None
        print(f"T={T:2d} L={L}: sdpa {micros(lambda: sdpa(q, k, v, allowed)):5.0f} us, "
              f"math {micros(lambda: math_attention(q, k, v, allowed)):5.0f} us")
