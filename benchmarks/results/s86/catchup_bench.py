"""Session 86: what a drafter catch-up costs at sixteen users, and where. 16 MT-bench first turns prefill in one
BatchDecoder (round-24 EAGLE-3.1, `--dtype auto`, compile auto, as `serve` loads them), run PLAIN plain rounds, then
one speculative round (chain of 1): each row's drafter first reads every position it missed, its prompt included
(the prefill leaves the prompt's features unread). Times each drafter forward of that round (sizes, seconds) and
prints the positions read per second; with --profile, the operators of the catch-up forwards.

    python benchmarks/results/s86/catchup_bench.py --threads 1 --repeats 3 [--profile]
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import anchorspec.decode.drafting as drafting
from anchorspec.api import load
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import TreeShape

DATA = Path("../shared/data/mt_bench/question.jsonl")
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"

log: list = []
inner_forward = drafting._forward


def timed_forward(passes):
    t = time.perf_counter()
    out = inner_forward(passes)
    log.append(([p.size for p in passes], [p.past for p in passes], passes[0].is_context, time.perf_counter() - t))
    return out


drafting._forward = timed_forward


def catch_up_once(engine, prompts, plain_rounds, profile=False):
    cfg = GenerationConfig(max_new_tokens=plain_rounds + 8)
    decs = [SpeculativeDecoding(engine.target, EagleProposer(engine.drafter), p, cfg, TreeShape.chain(1))
            for p in prompts]
    decoder = BatchDecoder(engine.target)
    decoder.round([(dec, True) for dec in decs])  # the prefills
    for _ in range(plain_rounds):
        decoder.round([(dec, False) for dec in decs])
    log.clear()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = decoder.round([(dec, True) for dec in decs], shape=TreeShape.chain(1))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    else:
        result = decoder.round([(dec, True) for dec in decs], shape=TreeShape.chain(1))
    records = list(log)
    for dec in decs:
        decoder.release(dec)
    return result, records


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--plain-rounds", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", DRAFTER, "auto", threads=args.threads, compile="auto")
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns][:args.rows]
    print(f"prompts: {sum(len(q) for q in prompts)} tokens over {len(prompts)} rows; {args.plain_rounds} plain rounds")
    catch_up_once(engine, prompts[:4], 4)  # warm-up
    rates = []
    for r in range(args.repeats):
        result, records = catch_up_once(engine, prompts, args.plain_rounds, args.profile and r == args.repeats - 1)
        context = [(sizes, pasts, s) for sizes, pasts, ctx, s in records if ctx]
        positions = sum(sum(sizes) for sizes, _, _ in context)
        seconds = sum(s for _, _, s in context)
        rates.append(positions / seconds)
        print(f"repeat {r}: round draft_s {result.draft_s:.3f} s, forward_s {result.forward_s:.3f} s; context forwards "
              f"{len(context)}: {positions} positions in {seconds:.3f} s ({positions / seconds:.0f}/s)")
        for sizes, pasts, s in context:
            print(f"    {len(sizes)} passes, sizes {min(sizes)}-{max(sizes)} (padded {len(sizes)} x {max(sizes)}), "
                  f"past {min(pasts)}-{max(pasts)}: {s * 1e3:.1f} ms")
    print(f"median {statistics.median(rates):.0f} positions/s")


if __name__ == "__main__":
    main()
