#!/usr/bin/env python
"""Grouped-query attention through torch SDPA, three ways, µs per call (models/attention.py chooses
between them): `enable_gqa=True` (for one query row without a mask, transformers' choice; with a mask
torch takes it too), keys and values repeated per query head with a mask (transformers' choice for a
multi-row forward with a mask, a tree or chain verify), and the query heads of a group laid out as rows
of their key/value head (one row: transformers' `pack_gqa`, which it uses only with a mask; several
rows: the mask repeated per group member).

    python benchmarks/bench_attention.py --threads 2 [--dtypes bfloat16,float32] [--heads 9 --kv-heads 3
        --head-dim 64] [--past 128,512] [--rows 1,2,3,4,8,16,32] [--json FILE]

Defaults are SmolLM2-135M's attention shapes. Median of `--repeats` timed batches of calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import environment, time_repeats, warn_if_busy  # noqa: E402


def per_call_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median over `repeats` batches of `calls` calls (after one warm-up batch), per call."""
    return time_repeats(lambda: [fn() for _ in range(calls)], repeats, warmup=1) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--past", default="128,512", help="keys already in the cache")
    ap.add_argument("--rows", default="1,2,3,4,8,16,32", help="query rows (new tokens) per call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    groups = H // KV
    results = []
    env = environment(args)
    print(f"{env['cpu']} ({env['cpu_capability']}), torch {env['torch']}, {args.threads} thread(s); "
          f"{H} query heads, {KV} key/value heads, head dim {D}; µs per call")
    print("| dtype | past keys | query rows | enable_gqa | repeated k/v + mask | group as rows |\n|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for past in (int(x) for x in args.past.split(",")):
            for T in (int(x) for x in args.rows.split(",")):
                L = past + T
                q = torch.randn(1, H, T, D).to(dtype)
                k, v = torch.randn(1, KV, L, D).to(dtype), torch.randn(1, KV, L, D).to(dtype)
                mask = torch.zeros(1, 1, T, L)
                mask[..., past:] = torch.triu(torch.full((T, T), float("-inf")), 1)  # a chain after the past
                mask = mask.to(dtype)
                one = None if T == 1 else mask  # one row sees every key: no mask needed

                def repeated():
                    kr = k[:, :, None].expand(1, KV, groups, L, D).reshape(1, H, L, D)
                    vr = v[:, :, None].expand(1, KV, groups, L, D).reshape(1, H, L, D)
                    return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)

                def as_rows():
                    m = None if one is None else one.repeat(1, 1, groups, 1)
                    out = F.scaled_dot_product_attention(q.reshape(1, KV, groups * T, D), k, v, attn_mask=m)
                    return out.reshape(1, H, T, D)

                with torch.inference_mode():
                    row = {"dtype": name, "past": past, "rows": T,
                           "enable_gqa": per_call_us(lambda: F.scaled_dot_product_attention(
                               q, k, v, attn_mask=one, enable_gqa=True), repeats=args.repeats),
                           "repeated_kv_mask": per_call_us(repeated, repeats=args.repeats),
                           "group_as_rows": per_call_us(as_rows, repeats=args.repeats)}
                results.append(row)
                print(f"| {name} | {past} | {T} | {row['enable_gqa']:.1f} | {row['repeated_kv_mask']:.1f} | "
                      f"{row['group_as_rows']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
