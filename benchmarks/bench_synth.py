#!/usr/bin/env python
"""Magpie query synthesis throughput (`anchorspec synth-prompts`), the two engines on the same target:
  hf        Hugging Face `model.generate`, sampled, on padded batches of the user-turn prefix (the engine
            synth-prompts had before session 27),
  batched   continuous batching over the project's batched rounds, every draw prefilling the prefix alone
            (synth-prompts in session 27),
  shared    the same with the shared prefix (synth-prompts' default since session 28): the prefix's rows
            are computed once and each draw's first token rides a batched round.
Each arm samples queries until `--queries` are kept (T=1, at most 96 new tokens), or, for hf, makes as
many batches as the batched arm used draws. Reports new tokens/s (every sampled token counts, the
end-of-turn one too) by wall clock and by this process's CPU time (robust to other jobs on the machine).

    OMP_NUM_THREADS=1 python benchmarks/bench_synth.py --threads 1 --queries 128 --out benchmarks/results/synth.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from anchorspec.data.magpie import synthesize_prompts, user_turn_prefix
from anchorspec.models.dtype import cpu_line
from anchorspec.models.target import load_target


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def hf_arm(target, draws: int, batch_size: int, max_new: int) -> dict:
    tok = target.tokenizer
    ids = tok(user_turn_prefix(tok), add_special_tokens=False, return_tensors="pt")["input_ids"]
    eot = tok.eos_token_id
    new, made = 0, 0
    w0, c0 = clocks()
    while made < draws:
        torch.manual_seed(made)
        with torch.inference_mode():
            gen = target.model.generate(input_ids=ids.repeat(batch_size, 1),
                                        attention_mask=torch.ones(batch_size, ids.shape[1], dtype=torch.long),
                                        do_sample=True, temperature=1.0,
                                        top_p=1.0, top_k=None, max_new_tokens=max_new, eos_token_id=eot,
                                        pad_token_id=eot)
        for r in gen[:, ids.shape[1]:].tolist():
            new += r.index(eot) + 1 if eot in r else len(r)
        made += batch_size
    w1, c1 = clocks()
    return {"engine": "hf", "draws": made, "new_tokens": new, "wall_s": w1 - w0, "cpu_s": c1 - c0}


def batched_arm(target, queries: int, batch_size: int, max_new: int, shared: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        w0, c0 = clocks()
        rep = synthesize_prompts(target, Path(d) / "q.jsonl", queries, batch_size=batch_size,
                                 max_new_tokens=max_new, progress=False, shared_prefix=shared)
        w1, c1 = clocks()
    return {"engine": "shared" if shared else "batched", "draws": rep["draws"], "kept": rep["prompts"],
            "dropped": rep["dropped"], "new_tokens": rep["new_tokens"], "wall_s": w1 - w0, "cpu_s": c1 - c0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=128, help="kept queries the batched arm makes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype)
    print(f"{cpu_line()}, torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, "
          f"batch {args.batch_size}, T=1, at most {args.max_new_tokens} new tokens")
    for shared in (False, True):  # warm-up: first-touch allocations, oneDNN kernel choice
        batched_arm(target, 2, args.batch_size, 8, shared)
    hf_arm(target, 1, 1, 8)
    batched = batched_arm(target, args.queries, args.batch_size, args.max_new_tokens, False)
    shared = batched_arm(target, args.queries, args.batch_size, args.max_new_tokens, True)
    hf = hf_arm(target, batched["draws"], args.batch_size, args.max_new_tokens)
    for r in (hf, batched, shared):
        r["tok_per_s_wall"] = r["new_tokens"] / r["wall_s"]
        r["tok_per_s_cpu"] = r["new_tokens"] / r["cpu_s"]
        print(f"  {r['engine']:8s}: {r['draws']} draws, {r['new_tokens']} new tokens, "
              f"{r['tok_per_s_wall']:.0f} tok/s wall, {r['tok_per_s_cpu']:.0f} tok/s per CPU-second")
    for r in (batched, shared):
        print(f"  {r['engine']} / hf: {r['tok_per_s_cpu'] / hf['tok_per_s_cpu']:.2f}x per CPU-second")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_line(), "torch": torch.__version__, "threads": args.threads,
                                        "dtype": args.dtype, "batch_size": args.batch_size,
                                        "results": [hf, batched, shared]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
