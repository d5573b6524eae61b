"""Session 85: the bar a probe must clear before a drafter server retries rows at sixteen users. In process (as
s82/round_ledger.py: one target, MT-bench first turns, T=0, 128 tokens, round-24 EAGLE-3.1 with its lookup chain,
shapes chosen as `serve` does, 1 thread). Each run is a new scheduler that first serves WARM requests 4 at a time
(as load_test.py's 4-user level precedes its 16-user one: the monitor learns the drafter's acceptance and a global
tau there), then N requests at 16 in flight, the part measured. Schedulers per block, in alternating order:
  plain  no drafter;
  old    retries skipped only while the global tau sits PROBE_MARGIN below tau*(16) (the rule before session 85);
  new    ... below the bar the probe must clear: tau*(16) raised by the switch-on margin where it leaves rows off.
Prints per block each drafter scheduler's total tokens/s over plain's in the measured part, the rows its retries
switched on, retries skipped and speculative rounds.

    git apply benchmarks/results/s85/probe-bar.patch   # the rule tried (not kept: docs/results.md, "Session 85")
    python benchmarks/results/s85/probe_bar.py --blocks 4 --threads 1
"""
import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from anchorspec.api import Engine, load
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler

DATA = Path("../shared/data/mt_bench/question.jsonl")
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"
new_futile = DriftMonitor._probe_futile


def old_futile(self, rows, margin=0.0):
    return new_futile(self, rows, 0.0)


def drain(scheduler, prompts, max_tokens, loop):
    for ids in prompts:
        scheduler.submit(ids, max_tokens, 0.0, loop=loop)
    t = time.perf_counter()
    while scheduler.running_count or scheduler.waiting_count:
        scheduler.step()
    return time.perf_counter() - t


def run(engine, warm, prompts, drafter, max_tokens, variant):
    DriftMonitor._probe_futile = old_futile if variant == "old" else new_futile
    monitor = DriftMonitor()
    scheduler = Scheduler(engine, monitor=monitor, max_running=16, calibrate=False,
                          lookup=LookupSettings() if drafter else None, shapes=BATCH_SHAPES if drafter else None)
    if drafter:
        scheduler.calibrate()
    loop = asyncio.new_event_loop()
    inner, spec_rounds, tokens = scheduler.decoder.round, [], []

    def counted(items, **kw):
        spec_rounds.append(sum(1 for _, s in items if s))
        result = inner(items, **kw)
        tokens.append(sum(len(r.tokens) for r in result.reports if not isinstance(r, BaseException)))
        return result

    scheduler.decoder.round = counted
    for a in range(0, len(warm), 4):  # the 4-user level
        drain(scheduler, warm[a:a + 4], max_tokens, loop)
    on0, skipped0, rounds0 = monitor.switches_on, monitor.probes_skipped, len(spec_rounds)
    wall = drain(scheduler, prompts, max_tokens, loop)
    loop.close()
    spec = sum(1 for n in spec_rounds[rounds0:] if n)
    return sum(tokens[rounds0:]) / wall, {
        "switches_on": monitor.switches_on - on0, "skipped": monitor.probes_skipped - skipped0, "spec_rounds": spec,
        "rounds": len(spec_rounds) - rounds0, "tau16": monitor.threshold_at(16), "global_tau": monitor.global_tau}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", DRAFTER, "auto", threads=args.threads, compile="auto")
    plain_engine = Engine(engine.target)
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    enc = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
    run(plain_engine, [], enc[-4:], False, 32, "plain")  # compile and warm both paths once
    run(engine, [], enc[-4:], True, 32, "new")
    ratios = {"old": [], "new": []}
    for block in range(args.blocks):
        start = block * (args.requests + args.warm)
        warm = [enc[(start + i) % len(enc)] for i in range(args.warm)]
        prompts = [enc[(start + args.warm + i) % len(enc)] for i in range(args.requests)]
        order = ("plain", "old", "new") if block % 2 == 0 else ("new", "old", "plain")
        speed, stats = {}, {}
        for name in order:
            speed[name], stats[name] = run(plain_engine if name == "plain" else engine, warm, prompts,
                                           name != "plain", args.max_tokens, name)
        for name in ("old", "new"):
            ratio = speed[name] / speed["plain"]  # total tokens/s of the measured part
            ratios[name].append(ratio)
            print(f"block {block} {name}: {ratio:.3f}x plain ({speed[name]:.1f} tok/s against {speed['plain']:.1f}); "
                  + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats[name].items()),
                  flush=True)
    for name, r in ratios.items():
        blocks = ", ".join(f"{x:.3f}" for x in r)
        print(f"{name}: median {statistics.median(r):.3f}x plain over {len(r)} blocks ({blocks})")
    print("new/old per block: " + ", ".join(f"{n / o:.3f}" for n, o in zip(ratios["new"], ratios["old"])))


if __name__ == "__main__":
    main()
