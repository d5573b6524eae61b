"""Session 86: where a drafter server's time goes at sixteen users, round by round. In process, as s85/probe_bar.py
(one target, MT-bench first turns, T=0, 128 tokens, round-24 EAGLE-3.1 with its lookup chain, shapes chosen as `serve`
does, 1 thread): each run is a new scheduler that serves WARM requests 4 at a time, then N at 16 in flight, measured.
Per block: the plain scheduler and the drafter's variants (`use`: "old", the catch-up as before session 86, eager by
size class, a prompt's pass eager; "new", through the drafter's graph; "backoff", that and failed probes backing off:
`git apply benchmarks/results/s86/failed-probe-backoff.patch` first, not kept), in alternating order.
Every measured round of the drafter's run is
put in one of three kinds:
  plain   no row speculated;
  probe   some rows speculated in a forward apart from the plain rows' (a split round: retries);
  spec    every row speculated;
with its wall time, tokens, rows, and the drafter forwards that read missed positions (context passes wider than
CATCH_UP tokens: catch-ups). Prints per kind the rounds, seconds, tokens, and the seconds plain rounds of as many rows
would have taken for those tokens (the plain run's median round time at that row count, over its tokens per round):
the excess is what the kind cost over plain.

    python benchmarks/results/s86/round_ledger.py --blocks 4 --threads 1 [--variants old,new]
"""
import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import anchorspec.decode.drafting as drafting
import anchorspec.decode.fallback as fallback
from anchorspec.api import Engine, load
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler

DATA = Path("../shared/data/mt_bench/question.jsonl")
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"
CATCH_UP = 8  # a context pass wider than this read positions missed in plain rounds (a riding row's is accepted + 1)

passes_log: list = []  # (sizes of the passes, context?, seconds) of each drafter forward in the current round
inner_forward = drafting._forward


def timed_forward(passes):
    t = time.perf_counter()
    out = inner_forward(passes)
    passes_log.append(([p.size for p in passes], passes[0].is_context, time.perf_counter() - t))
    return out


drafting._forward = timed_forward
new_one_graph, new_static_slots = drafting._one_graph_forward, drafting.static_slots


def use(variant):
    """'old': drafter passes through the graph only past the prompt on slots 0..B-1, wide ones by size class;
    'new': this tree's passes without the failed-probe backoff; 'backoff': with it (fallback.FAILED_PROBE_BACKOFF)."""
    fallback.FAILED_PROBE_BACKOFF = variant == "backoff"
    old = variant == "old"
    drafting._one_graph_forward = (lambda group: False) if old else new_one_graph
    drafting.static_slots = (lambda idx, one_slot: idx == list(range(len(idx)))) if old else new_static_slots


def drain(scheduler, prompts, max_tokens, loop):
    for ids in prompts:
        scheduler.submit(ids, max_tokens, 0.0, loop=loop)
    t = time.perf_counter()
    while scheduler.running_count or scheduler.waiting_count:
        scheduler.step()
    return time.perf_counter() - t


def run(engine, warm, prompts, drafter, max_tokens):
    monitor = DriftMonitor()
    scheduler = Scheduler(engine, monitor=monitor, max_running=16, calibrate=False,
                          lookup=LookupSettings() if drafter else None, shapes=BATCH_SHAPES if drafter else None)
    if drafter:
        scheduler.calibrate()
    loop = asyncio.new_event_loop()
    inner, rounds = scheduler.decoder.round, []

    def ledger(items, **kw):
        passes_log.clear()
        t = time.perf_counter()
        result = inner(items, **kw)
        wall = time.perf_counter() - t
        spec = sum(1 for _, s in items if s)
        batched = sum(1 for dec, _ in items if dec.started)
        kind = "plain" if not spec else "spec" if spec == len(items) else "probe"
        catch = [(sizes, s) for sizes, ctx, s in passes_log if ctx and max(sizes) > CATCH_UP]
        rounds.append({
            "kind": kind, "rows": len(items), "batched": batched, "spec_rows": spec, "wall": wall,
            "tokens": sum(len(r.tokens) for r in result.reports if not isinstance(r, BaseException)),
            "prefills": result.prefills, "draft_s": result.draft_s, "forward_s": result.forward_s,
            "forwards": result.forwards, "catch_s": sum(s for _, s in catch),
            "catch_tokens": sum(sum(sizes) for sizes, _ in catch), "catch_forwards": len(catch),
            "shape": str(monitor.shape) if drafter else None})
        return result

    scheduler.decoder.round = ledger
    for a in range(0, len(warm), 4):  # the 4-user level
        drain(scheduler, warm[a:a + 4], max_tokens, loop)
    start = len(rounds)
    wall = drain(scheduler, prompts, max_tokens, loop)
    loop.close()
    return wall, rounds[start:], monitor


def plain_pace(rounds):
    """Median seconds per token of the plain run's rounds without prefills, by row count."""
    by_rows = defaultdict(list)
    for r in rounds:
        if not r["prefills"] and r["tokens"]:
            by_rows[r["rows"]].append(r["wall"] / r["tokens"])
    return {rows: statistics.median(v) for rows, v in by_rows.items()}


def summary(rounds, pace):
    out = {}
    for kind in ("plain", "probe", "spec"):
        mine = [r for r in rounds if r["kind"] == kind and not r["prefills"]]
        if not mine:
            continue
        seconds = sum(r["wall"] for r in mine)
        tokens = sum(r["tokens"] for r in mine)
        at_plain = sum(r["tokens"] * pace.get(r["rows"], min(pace.values())) for r in mine)
        out[kind] = {"rounds": len(mine), "seconds": round(seconds, 3), "tokens": tokens,
                     "excess_s": round(seconds - at_plain, 3),
                     "draft_s": round(sum(r["draft_s"] for r in mine), 3),
                     "catch_s": round(sum(r["catch_s"] for r in mine), 3),
                     "catch_tokens": sum(r["catch_tokens"] for r in mine),
                     "forwards": sum(len(r["forwards"]) for r in mine)}
    prefill = [r for r in rounds if r["prefills"]]
    out["prefill rounds"] = {"rounds": len(prefill), "seconds": round(sum(r["wall"] for r in prefill), 3)}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default="old,new",
                   help="drafter variants per block, comma-separated: old, new, backoff")
    p.add_argument("--out", default=None, help="write every round of every run here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", DRAFTER, "auto", threads=args.threads, compile="auto")
    plain_engine = Engine(engine.target)
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    enc = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
    run(plain_engine, [], enc[-4:], False, 32)  # compile and warm both paths once
    for name in ("old", "new"):
        use(name)
        run(engine, [], enc[-4:], True, 32)
    records, variants = [], tuple(args.variants.split(","))
    ratios = {name: [] for name in variants}
    for block in range(args.blocks):
        start = block * (args.requests + args.warm)
        warm = [enc[(start + i) % len(enc)] for i in range(args.warm)]
        prompts = [enc[(start + args.warm + i) % len(enc)] for i in range(args.requests)]
        order = ("plain", *variants) if block % 2 == 0 else (*variants[::-1], "plain")
        walls, ledgers = {}, {}
        for name in order:
            use(name)
            walls[name], ledgers[name], monitor = run(plain_engine if name == "plain" else engine, warm, prompts,
                                                      name != "plain", args.max_tokens)
        tokens = {name: sum(r["tokens"] for r in ledgers[name]) for name in walls}
        speed = {name: tokens[name] / walls[name] for name in walls}
        pace = plain_pace(ledgers["plain"])
        for name in variants:
            ratios[name].append(speed[name] / speed["plain"])
            print(f"block {block} {name}: {speed[name] / speed['plain']:.3f}x plain ({speed[name]:.1f} "
                  f"against {speed['plain']:.1f} tok/s; {walls[name]:.2f} s against {walls['plain']:.2f} s)")
            for kind, row in summary(ledgers[name], pace).items():
                print(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        plain_rows = summary(ledgers["plain"], pace)
        print("  plain run: " + "; ".join(f"{k}: " + ", ".join(f"{a} {b}" for a, b in v.items())
                                          for k, v in plain_rows.items()), flush=True)
        records.append({"block": block, "walls": walls, "tokens": tokens, "ledgers": ledgers})
    for name, r in ratios.items():
        print(f"{name}: median {statistics.median(r):.3f}x plain over {len(r)} blocks ("
              + ", ".join(f"{x:.3f}" for x in r) + ")")
    if len(variants) == 2:
        a, b = variants
        print(f"{b}/{a} per block: " + ", ".join(f"{y / x:.3f}" for x, y in zip(ratios[a], ratios[b])))
    if args.out:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
