"""Session 82: where a shape-choosing drafter server loses time against a plain one at many users. In process (as
s81/batch_shapes.py: one target, MT-bench first turns, T=0, 128 tokens, round-24 EAGLE-3.1 with its lookup chain),
every round of the drafter scheduler is booked by kind (plain, speculative, speculative right after plain rows:
catch-up, split: some rows apart) and row count, with its wall time and the tokens it emitted; each kind's loss is
its time minus what plain rounds of the same row count (this run's own mean per plain round) would take to emit
the same tokens. Blocks alternate plain and drafter.

    python benchmarks/results/s82/round_ledger.py --users 16 --blocks 3 --threads 1

Each block runs a plain scheduler and three drafter schedulers: "old" (round costs as moving averages, rounds that grew
a cache sampled, rows switched on at tau* itself, no pacing: the rules before session 82), "new" (today's defaults)
and "lazy" (today's, but each drafter reads its prompt with its first draft instead of at the prefill). Earlier runs
of this script compared "margin0" (rows switched on at tau* itself: ledger-margin.log) and "nopace" (wide rounds priced
at their measured seconds: ledger-pace.log).
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from anchorspec.api import Engine, load
from anchorspec.decode.engine import SpeculativeDecoding
from anchorspec.decode.fallback import DriftMonitor, shape_key
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler

DATA = Path("../shared/data/mt_bench/question.jsonl")
DRAFTER = "checkpoints/smollm2-135m-instruct-eagle3.1"


def run(engine, prompts, users, drafter, max_tokens, shapes=BATCH_SHAPES, old=False, margin=None, pace=True,
        read_prompt=True):
    """`old`: the rules before session 82 (round costs as moving averages, rounds that grew a cache sampled, rows
    switched on at tau* itself); `margin`: the switch-on margin (None: the default)."""
    monitor = DriftMonitor(round_cost_window=None) if old else DriftMonitor()
    if old:
        monitor.switch_on_margin = 0.0
    if margin is not None:
        monitor.switch_on_margin = margin
    monitor.follow_pace = pace and not old
    SpeculativeDecoding.read_prompt_at_prefill = read_prompt
    scheduler = Scheduler(engine, monitor=monitor, max_running=users, calibrate=False,
                          lookup=LookupSettings() if drafter else None, shapes=shapes if drafter else None)
    if drafter:
        scheduler.calibrate()
    loop = asyncio.new_event_loop()
    inner, book = scheduler.decoder.round, []

    def traced(items, split=False, chains=None, shape=None, **kw):
        t0 = time.perf_counter()
        rode = scheduler._rode
        probing = scheduler.monitor.last_probe == scheduler.monitor.rounds if drafter else False
        result = inner(items, split=split, chains=chains, shape=shape, **kw)
        if old:
            result.one_off = result.compiled
        spec = sum(1 for _, s in items if s)
        tokens = sum(len(r.tokens) for r in result.reports if not isinstance(r, BaseException))
        book.append({"s": time.perf_counter() - t0, "rows": len(items), "spec": spec, "tokens": tokens,
                     "prefills": result.prefills, "split": split, "catch_up": bool(spec) and not rode,
                     "probing": probing, "shape": shape_key(shape) if shape else None})
        return result

    scheduler.decoder.round = traced
    for ids in prompts:
        scheduler.submit(ids, max_tokens, 0.0, loop=loop)
    t = time.perf_counter()
    while scheduler.running_count or scheduler.waiting_count:
        scheduler.step()
    wall = time.perf_counter() - t
    loop.close()
    return wall, book, scheduler.monitor


def kind(r):
    if r["prefills"]:
        return "prefill"
    if not r["spec"]:
        return "plain"
    return ("probe " if r["probing"] else "") + ("catch-up" if r["catch_up"] else "split" if r["split"] else "spec")


def ledger(book, plain_cost):
    """Per kind and row bucket: rounds, seconds, tokens, and seconds lost against plain rounds' cost per token."""
    out = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for r in book:
        bucket = "16" if r["rows"] >= 13 else "5-12" if r["rows"] >= 5 else "1-4"
        k = (kind(r), bucket)
        per_token = plain_cost.get(r["rows"])
        out[k][0] += 1
        out[k][1] += r["s"]
        out[k][2] += r["tokens"]
        if per_token is not None:  # a prefill round's batched rows emit tokens too
            out[k][3] += r["s"] - r["tokens"] * per_token
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--requests-per-user", type=int, default=3)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--out", help="every round of every run, as JSON lines")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", DRAFTER, "auto", threads=args.threads, compile="auto")
    plain_engine = Engine(engine.target)
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    warm = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns[-4:]]
    run(plain_engine, warm, 4, False, 32)
    run(engine, warm, 4, True, 32)
    n = args.users * args.requests_per_user
    for block in range(args.blocks):
        start = (args.start + block * n) % len(turns)
        prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in (turns * 2)[start:start + n]]
        results = {}
        order = ("plain", "old", "lazy", "new") if block % 2 == 0 else ("new", "lazy", "old", "plain")
        for name in order:
            results[name] = run(plain_engine if name == "plain" else engine, prompts, args.users, name != "plain",
                                args.max_tokens, old=name == "old", read_prompt=name not in ("old", "lazy"))
        if args.out:
            with open(args.out, "a") as f:
                for name, (_, b, _) in results.items():
                    f.write(json.dumps({"block": block, "scheduler": name, "rounds": b}) + "\n")
        for variant in ("old", "lazy", "new"):
            report(block, variant, results, args)


def report(block, variant, results, args):
    (pw, pbook, _), (dw, dbook, monitor) = results["plain"], results[variant]
    per_rows = defaultdict(list)
    for r in pbook + dbook:
        if kind(r) == "plain":
            per_rows[r["rows"]].append(r["s"] / max(r["tokens"], 1))
    plain_cost = {rows: statistics.fmean(v) for rows, v in per_rows.items()}
    ptok = sum(r["tokens"] for r in pbook)
    dtok = sum(r["tokens"] for r in dbook)
    print(f"block {block}, {variant}: plain {ptok / pw:.1f} tok/s ({pw:.2f} s, "
          f"rounds {sum(r['s'] for r in pbook):.2f} s), "
          f"drafter {dtok / dw:.1f} tok/s ({dw:.2f} s, rounds {sum(r['s'] for r in dbook):.2f} s): "
          f"{(dtok / dw) / (ptok / pw):.3f}x", flush=True)
    for name, b in (("plain", pbook), (variant, dbook)):
        for (k, bucket), (n_r, s, tok, lost) in sorted(ledger(b, plain_cost).items()):
            print(f"  {name:8s} {k:18s} rows {bucket:5s}: {n_r:4d} rounds {s:7.2f} s {tok:6d} tokens "
                  f"lost vs plain {lost:+.2f} s", flush=True)
    m = monitor
    print("  priced at end: " + ", ".join(
        f"{shape_key(s)} t*={m.threshold_at(args.users, s) or 0:.2f} tau={m.expected_shape_tau(s):.2f}"
        for s in BATCH_SHAPES) + f"; switches off/on {m.switches_off}/{m.switches_on}, probes skipped "
        f"{m.probes_skipped}", flush=True)
    print("  curves at %d rows (ms): plain %.1f, " % (args.users, 1e3 * m.forward(args.users, 1)) + ", ".join(
        f"{shape_key(s)} verify {1e3 * m.forward(args.users, s.total_tokens):.1f} draft "
        f"{1e3 * (m._drafting[shape_key(s)](args.users) or 0):.1f}" for s in BATCH_SHAPES
        if shape_key(s) in m._drafting), flush=True)


if __name__ == "__main__":
    main()
