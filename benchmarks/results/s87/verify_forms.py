"""Session 87: what the step graph's attention form costs per step shape, both forms' graphs in one process. The target
is loaded twice (`--dtype auto`, compile on, as `serve` loads it): once with the one-row verdict this machine probed
(models/attention.py: graph_form) and once with it preset to the other form (s86/attn_form.py's way), each graph then
compiled or read from the cache. 16 MT-bench first turns are prefilled and decoded plainly for CONTEXT steps in each
(one BatchKV per load), then batch_forward of chains of each width (nothing committed) is timed on all rows and on one
row, the two loads interleaved, medians of REPEATS.

    python benchmarks/results/s87/verify_forms.py --threads 1 --context 64,160
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anchorspec.api import load
from anchorspec.decode.batch import batch_forward
from anchorspec.decode.engine import GenerationConfig, PlainDecoding
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import DraftTree
from anchorspec.models import attention

DATA = Path("../shared/data/mt_bench/question.jsonl")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", default="64,160", help="plain steps decoded before each timing, comma-separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--widths", default="1,2,3,4,16")
    p.add_argument("--probed-only", action="store_true", help="load only the probed verdict's graph")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    memo = ("cpu", torch.bfloat16, 3, 3, 64, args.threads)  # SmolLM2-135M's heads
    probed = attention.one_row_form(torch.device("cpu"), torch.bfloat16, 3, 3, 64)
    forms = (probed,) if args.probed_only else (probed, attention.ROWS if probed == attention.GQA else attention.GQA)
    steps = [int(x) for x in args.context.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    setups = {}
    for form in forms:
        attention._one_row_form[memo] = form
        engine = load("smollm2-135m-instruct", None, "auto", threads=args.threads, compile=True)
        engine.target.load_graph()
        setups[form] = engine
    attention._one_row_form[memo] = probed
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    prompts = [setups[probed].encode_chat([{"role": "user", "content": t}]) for t in turns][:args.rows]
    states = {}
    for form, engine in setups.items():
        decs = [PlainDecoding(engine.target, q, GenerationConfig(max_new_tokens=max(steps) + 8))
                for q in prompts]
        states[form] = (engine.target, BatchDecoder(engine.target), decs)
    print(f"probed one-row form: {probed}, graph forms {attention.graph_form(torch.device('cpu'), torch.bfloat16, 3, 3, 64)}"
          f"; {args.rows} rows, {torch.bfloat16}, {args.threads} thread(s)")
    done = 0
    for target_steps in steps:
        for form, (target, decoder, decs) in states.items():
            for _ in range(target_steps - done + (1 if not done else 0)):
                decoder.round([(d, None) for d in decs])
        done = target_steps
        ctx = statistics.fmean(d.cache.length for d in states[probed][2])
        times = {(f, n, w): [] for f in forms for n in (args.rows, 1) for w in widths}
        with torch.inference_mode():
            for r in range(args.repeats + 1):
                for w in widths:
                    for n in (args.rows, 1):
                        for form in (forms if r % 2 else forms[::-1]):
                            target, _, decs = states[form]
                            slots = [d.cache for d in decs[:n]]
                            trees = [DraftTree.chain(torch.arange(w) + 100) for _ in slots]
                            t = time.perf_counter()
                            batch_forward(target, slots, trees)
                            if r:
                                times[form, n, w].append(time.perf_counter() - t)
        for n in (args.rows, 1):
            print(f"context ~{ctx:.0f}, {n} row(s):")
            for w in widths:
                ms = {f: statistics.median(times[f, n, w]) * 1e3 for f in forms}
                ratio = f"  ({forms[1]} / {forms[0]} {ms[forms[1]] / ms[forms[0]]:.2f})" if len(forms) > 1 else ""
                print(f"  width {w:2d}: " + ", ".join(f"{f} {ms[f]:6.1f} ms" for f in forms) + ratio, flush=True)


if __name__ == "__main__":
    main()
