"""Session 81: a drafter server whose rounds choose their draft shape by the batch's row count (Scheduler(shapes=
BATCH_SHAPES), what `anchorspec serve` now does with no --chain/--tree) against the same server drafting the default
4,4,16 tree in every round, and a plain server; in process (Scheduler.step, no HTTP), one target for all three (the
same weights and buffers: two engines differ 3-4 % per step, session 80). Requests: MT-bench first turns (chat
template, T=0, 128 tokens), `users` in flight of `requests`, the round-24 EAGLE-3.1 release with its lookup chain
(serve's defaults). Blocks alternate the order of the three. Each scheduler is new and calibrated (not timed).

    python benchmarks/results/s81/batch_shapes.py --users 4,16 --blocks 3 --threads 1 --out FILE.json
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from anchorspec.api import Engine, load
from anchorspec.decode.fallback import DriftMonitor, shape_key
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler

DATA = Path("../shared/data/mt_bench/question.jsonl")
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"
LOOKUP = True  # --no-lookup: the drafter's trees alone


def run(engine, prompts, users: int, variant: str, max_tokens: int) -> dict:
    drafter = variant != "plain"
    scheduler = Scheduler(engine, monitor=DriftMonitor(), max_running=users, calibrate=False,
                          lookup=LookupSettings() if drafter and LOOKUP else None,
                          shapes=BATCH_SHAPES if variant == "choose" else None)
    t = time.perf_counter()
    if drafter:
        scheduler.calibrate()
    calibration = time.perf_counter() - t
    loop = asyncio.new_event_loop()
    inner, shapes, spec_rounds, timing = scheduler.decoder.round, Counter(), [0, 0], []

    def traced(items, split=False, chains=None, shape=None, **kw):
        t0 = time.perf_counter()
        result = inner(items, split=split, chains=chains, shape=shape, **kw)
        speculating = any(s for _, s in items if s is not None)
        if not result.prefills:
            timing.append((speculating, time.perf_counter() - t0, result.draft_s, result.forward_s, result.width,
                           not scheduler._rode))
        spec_rounds[0] += 1
        spec_rounds[1] += speculating
        if speculating:
            shapes[shape_key(shape) if shape else "default"] += 1
        return result

    scheduler.decoder.round = traced
    handles = [scheduler.submit(ids, max_tokens, 0.0, loop=loop) for ids in prompts]
    t = time.perf_counter()
    while scheduler.running_count or scheduler.waiting_count:
        scheduler.step()
    wall = time.perf_counter() - t
    loop.run_until_complete(asyncio.sleep(0))  # the events the worker queued through call_soon_threadsafe
    m = scheduler.monitor
    priced = {shape_key(s): {"tau_star": m.threshold_at(users, s), "tau": m.expected_shape_tau(s)}
              for s in scheduler.shapes}
    tokens = 0
    outputs = []
    while handles:
        h = handles.pop(0)
        got = []
        while not h.queue.empty():
            kind, value = h.queue.get_nowait()
            if kind == "tokens":
                got += value
        outputs.append(got)
        tokens += len(got)
    loop.close()
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "calibration_s": calibration,
            "rounds": spec_rounds[0], "speculative_rounds": spec_rounds[1], "shapes": dict(shapes), "priced": priced,
            "switches": [m.switches_off, m.switches_on], "round_ms": round_ms(timing),
            "outputs": outputs}


def round_ms(timing) -> dict:
    """Median ms of rounds without prefills, by kind: (whole round, drafting, target forward), and their widths."""
    out = {}
    for name, pick in (("plain", lambda r: not r[0]), ("speculative", lambda r: r[0] and not r[5]),
                       ("speculative after plain", lambda r: r[0] and r[5])):
        rows = [r for r in timing if pick(r)]
        if rows:
            out[name] = {"rounds": len(rows), "round": 1e3 * statistics.median(r[1] for r in rows),
                         "draft": 1e3 * statistics.median(r[2] for r in rows),
                         "forward": 1e3 * statistics.median(r[3] for r in rows),
                         "width": statistics.median(r[4] for r in rows)}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--users", default="4,16")
    p.add_argument("--requests-per-user", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-lookup", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    global LOOKUP
    LOOKUP = not args.no_lookup
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", DRAFTER, "auto", threads=args.threads, compile="auto")
    engines = {"plain": Engine(engine.target), "tree": engine, "choose": engine}
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    record = {"config": vars(args), "dtype": str(engine.target.dtype), "compiled": engine.target.compiled,
              "runs": []}
    variants = ["plain", "tree", "choose"]
    warm = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns[-4:]]
    for variant in variants:  # graphs loaded, every shape's drafter passes run once
        run(engines[variant], warm, 4, variant, 32)
    for users in (int(u) for u in args.users.split(",")):
        n = users * args.requests_per_user
        for block in range(args.blocks):
            start = (block * n) % len(turns)
            prompts = [engine.encode_chat([{"role": "user", "content": t}])
                       for t in (turns * 2)[start:start + n]]
            order = variants if block % 2 == 0 else variants[::-1]
            outs = {}
            for variant in order:
                r = run(engines[variant], prompts, users, variant, args.max_tokens)
                outs[variant] = r.pop("outputs")
                r.update(users=users, block=block, variant=variant)
                record["runs"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
            record["runs"][-1]["same_as_plain"] = {v: sum(a == b for a, b in zip(outs[v], outs["plain"]))
                                                   for v in variants}
        rates = {v: [r["tok_s"] for r in record["runs"] if r["users"] == users and r["variant"] == v]
                 for v in variants}
        ratios = {v: [a / b for a, b in zip(rates[v], rates["plain"])] for v in variants}
        print(f"users {users}: " + "  ".join(f"{v} {statistics.median(rates[v]):.1f} tok/s "
                                             f"({statistics.median(ratios[v]):.2f}x plain, per block "
                                             f"{', '.join(f'{x:.2f}' for x in ratios[v])})" for v in variants),
              file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
