"""Session 77: where a drafter server's time goes at sixteen users, round by round, in process (no HTTP).

`anchorspec serve`'s Scheduler driven from this thread (Scheduler.step), 16 in flight out of N MT-bench first turns
(chat template, T=0, 128 tokens), the round-24 EAGLE-3.1 release with its lookup chain (serve's defaults), against a
plain Scheduler on the same prompts; both on one engine of the target (bf16 by --dtype auto here, the AOT graph,
1 thread). Every round is timed and classed: plain (no row speculates), speculative (every row), split (a probe's
rows apart), and whether its drafters caught up on a plain stretch. Prints the share of time per class.

    python benchmarks/results/s77/probe_rounds.py --requests 48 --out benchmarks/results/s77/probe-rounds.json
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from anchorspec.api import load
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
DRAFTER = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"


def run(engine, prompts, drafter: bool, max_tokens: int, rounds: list, monitor=None, warm=()) -> float:
    """The wall time of `prompts` through a Scheduler (16 in flight), each round appended to `rounds`; `warm`
    requests first, one at a time and not timed (probe_backoff.py). `monitor`: the scheduler's (a new one)."""
    scheduler = Scheduler(engine, monitor=monitor or DriftMonitor(), max_running=16,
                          lookup=LookupSettings() if drafter else None, calibrate=False)
    if drafter:
        scheduler.calibrate()
    loop = asyncio.new_event_loop()
    for ids in warm:
        scheduler.submit(ids, max_tokens, 0.0, loop=loop)
        while scheduler.running_count or scheduler.waiting_count:
            scheduler.step()
    inner = scheduler.decoder.round

    def timed(items, split=False, chains=None):
        t = time.perf_counter()
        result = inner(items, split=split, chains=chains)
        on = [s for _, s in items if s is not None]
        rounds.append({"rows": len(items), "speculating": sum(bool(s) for s in on), "split": split,
                       "seconds": time.perf_counter() - t, "draft_s": result.draft_s, "forward_s": result.forward_s,
                       "width": result.width, "prefills": result.prefills, "catch_up": drafter and not scheduler._rode})
        return result

    scheduler.decoder.round = timed
    for ids in prompts:
        scheduler.submit(ids, max_tokens, 0.0, loop=loop)
    t = time.perf_counter()
    while scheduler.running_count or scheduler.waiting_count:
        scheduler.step()
    return time.perf_counter() - t


def summary(rounds: list, wall: float, tokens: int) -> dict:
    def kind(r):
        if r["prefills"]:
            return "with prefills"
        if not r["speculating"]:
            return "plain"
        return "split (probe)" if r["split"] else "speculative"

    out = {"wall_s": wall, "tok_s": tokens / wall, "rounds": len(rounds), "classes": {}}
    for name in ("plain", "speculative", "split (probe)", "with prefills"):
        rs = [r for r in rounds if kind(r) == name]
        if rs:
            out["classes"][name] = {"rounds": len(rs), "seconds": sum(r["seconds"] for r in rs),
                                    "share": sum(r["seconds"] for r in rs) / wall,
                                    "median_ms": 1e3 * statistics.median(r["seconds"] for r in rs),
                                    "draft_s": sum(r["draft_s"] for r in rs),
                                    "catch_up_rounds": sum(bool(r["catch_up"]) for r in rs)}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {False: load("smollm2-135m-instruct", None, "auto", threads=args.threads, compile="auto"),
               True: load("smollm2-135m-instruct", str(DRAFTER), "auto", threads=args.threads, compile="auto")}
    engine = engines[True]
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()][:args.requests]
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
    record = {"config": vars(args), "dtype": str(engine.target.dtype), "compiled": engine.target.compiled}
    for name, drafter in (("plain", False), ("drafter", True), ("plain-again", False)):
        rounds: list = []
        wall = run(engines[drafter], prompts, drafter, args.max_tokens, rounds)
        record[name] = summary(rounds, wall, args.requests * args.max_tokens)
        print(name, json.dumps(record[name], indent=1), file=sys.stderr)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
