"""Session 86: what a 16-row target forward costs per padded width (1-8 new tokens a row), against the GEMMs alone at
the same token count. 16 MT-bench first turns prefilled in one BatchKV (`--dtype auto`, compile auto, as `serve` loads
the target), then timed batch_forward calls of chains of each width (nothing committed), interleaved, medians of
REPEATS; the GEMMs: the target's projections (from its config) and its head as eager F.linear on random inputs of
16 x width rows, in the target's dtype (unpacked weights: what a plain eager product costs).

    python benchmarks/results/s86/verify_width.py --threads 1
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from anchorspec.api import load
from anchorspec.decode.batch import batch_forward
from anchorspec.decode.engine import GenerationConfig, PlainDecoding
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import DraftTree

DATA = Path("../shared/data/mt_bench/question.jsonl")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", None, "auto", threads=args.threads, compile="auto")
    target = engine.target
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns][:args.rows]
    decs = [PlainDecoding(target, q, GenerationConfig(max_new_tokens=4)) for q in prompts]
    decoder = BatchDecoder(target)
    decoder.round([(d, None) for d in decs])  # prefills
    slots = [d.cache for d in decs]
    widths = (1, 2, 3, 4, 5, 8)
    times = {w: [] for w in widths}
    with torch.inference_mode():
        for r in range(args.repeats + 1):
            for w in widths:
                trees = [DraftTree.chain(torch.arange(w) + 100) for _ in slots]
                t = time.perf_counter()
                batch_forward(target, slots, trees)
                if r:
                    times[w].append(time.perf_counter() - t)
        c = target.config
        h, kv = c.hidden_size, c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
        shapes = [(h, h), (kv, h), (kv, h), (h, h), (c.intermediate_size, h), (c.intermediate_size, h),
                  (h, c.intermediate_size)] * c.num_hidden_layers
        weights = [torch.randn(o, i, dtype=target.dtype) * 0.02 for o, i in shapes]
        head = torch.randn(c.vocab_size, h, dtype=target.dtype) * 0.02
        gemm = {}
        for w in widths:
            m = args.rows * w
            xs = {i: torch.randn(m, i, dtype=target.dtype) for _, i in shapes}
            samples = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for weight in weights:
                    F.linear(xs[weight.shape[1]], weight)
                F.linear(xs[h], head)  # every row's logits (a verify reads them all)
                samples.append(time.perf_counter() - t)
            gemm[w] = statistics.median(samples)
    ctx = sum(len(q) for q in prompts) / len(prompts)
    print(f"{args.rows} rows, mean context {ctx:.0f} tokens, {target.dtype}, {args.threads} thread(s), "
          f"compiled {target.compiled}; GEMMs: {len(weights)} projections + the head, eager F.linear")
    base = statistics.median(times[1])
    for w in widths:
        f = statistics.median(times[w])
        print(f"width {w}: forward {f * 1e3:6.1f} ms ({f / base:.2f}x width 1), "
              f"eager F.linear alone {gemm[w] * 1e3:6.1f} ms "
              f"({args.rows * w} tokens)")


if __name__ == "__main__":
    main()
