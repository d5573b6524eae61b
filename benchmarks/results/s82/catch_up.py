"""Session 82: what a drafter's catch-up costs in a batched round. 16 (--rows) sequences of MT-bench first turns
decode `--plain` plain rounds together, then speculative rounds (a chain of 2, no lookup); the first of them makes
every drafter read the features of the positions it missed. Prints each round's drafting and forward times, and a
cProfile of the catch-up round's drafting by function (torch ops included).

    python benchmarks/results/s82/catch_up.py --rows 16 --plain 64 --threads 1
"""
import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from anchorspec.api import load
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import TreeShape

DATA = Path("../shared/data/mt_bench/question.jsonl")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--plain", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto",
                  threads=args.threads, compile="auto")
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()][:args.rows]
    shape = TreeShape.chain(2)
    for repeat in range(2):
        decs = [SpeculativeDecoding(engine.target, EagleProposer(engine.drafter),
                                    engine.encode_chat([{"role": "user", "content": t}]),
                                    GenerationConfig(max_new_tokens=args.plain + 40), shape) for t in turns]
        decoder = BatchDecoder(engine.target)
        decoder.round([(d, False) for d in decs])  # prefills
        for _ in range(args.plain):
            r = decoder.round([(d, False) for d in decs], shape=shape, lookup=False)
        print(f"repeat {repeat}: plain round {1e3 * r.forward_s:.1f} ms (forward)")
        for k in range(4):
            prof = cProfile.Profile() if (k == 0 and args.profile and repeat == 1) else None
            if prof:
                prof.enable()
            t = time.perf_counter()
            r = decoder.round([(d, True) for d in decs if not d.finished], shape=shape, lookup=False)
            wall = time.perf_counter() - t
            if prof:
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue())
            print(f"  speculative round {k}{' (catch-up)' if k == 0 else ''}: {1e3 * wall:.1f} ms, drafting "
                  f"{1e3 * r.draft_s:.1f} ms in {r.draft_passes} levels, forward {1e3 * r.forward_s:.1f} ms, "
                  f"compiled {r.compiled}, one-off {r.one_off}")
        for d in decs:
            decoder.release(d)


if __name__ == "__main__":
    main()
