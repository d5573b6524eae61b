"""Session 87: the drafter server's rounds at sixteen users one by one, with what its monitor believed when it chose
each: s86/round_ledger.py's workload and ledger (imported: its timed drafter forward is patched in), each round also
carrying tau*(rows) for the shape then current, the global tau, and the target forward's and drafting's seconds.
Prints the 16-user stretch as runs of plain rounds and each speculative round in full.

    python benchmarks/results/s87/round_trace.py --blocks 2 --threads 1 --out trace.json
"""
import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s86"))
import round_ledger as rl  # noqa: E402  (patches the drafter's forward to time its passes)

from anchorspec.api import Engine, load  # noqa: E402
from anchorspec.decode.fallback import DriftMonitor  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler  # noqa: E402


def run(engine, warm, prompts, drafter, max_tokens):
    """s86/round_ledger.run, each round also recording the monitor's beliefs (the module docstring)."""
    monitor = DriftMonitor()
    scheduler = Scheduler(engine, monitor=monitor, max_running=16, calibrate=False,
                          lookup=LookupSettings() if drafter else None, shapes=BATCH_SHAPES if drafter else None)
    if drafter:
        scheduler.calibrate()
    loop = asyncio.new_event_loop()
    inner, rounds = scheduler.decoder.round, []

    def traced(items, **kw):
        rl.passes_log.clear()
        t = time.perf_counter()
        result = inner(items, **kw)
        wall = time.perf_counter() - t
        spec = sum(1 for _, s in items if s)
        catch = [(sizes, s) for sizes, ctx, s in rl.passes_log if ctx and max(sizes) > rl.CATCH_UP]
        rows = len(items)
        rounds.append({
            "kind": "plain" if not spec else "spec" if spec == rows else "probe", "rows": rows, "spec_rows": spec,
            "wall": wall, "tokens": sum(len(r.tokens) for r in result.reports if not isinstance(r, BaseException)),
            "prefills": result.prefills, "draft_s": result.draft_s, "forward_s": result.forward_s, "forwards": result.forwards,
            "catch_s": sum(s for _, s in catch), "catch_tokens": sum(sum(sizes) for sizes, _ in catch),
            "shape": str(monitor.shape) if drafter else None,
            "tstar": monitor.threshold_at(rows) if drafter else None,
            "global_tau": monitor.global_tau if drafter else None,
            "plain_cost": monitor.forward(rows, 1) if drafter else None,
            "verify_cost": (monitor.verify_cost(rows, monitor.width) if drafter and monitor.width else None),
            "drafting_cost": monitor.drafting_cost(rows) if drafter else None})
        return result

    scheduler.decoder.round = traced
    for a in range(0, len(warm), 4):
        rl.drain(scheduler, warm[a:a + 4], max_tokens, loop)
    start = len(rounds)
    wall = rl.drain(scheduler, prompts, max_tokens, loop)
    loop.close()
    return wall, rounds[start:]


def show(rounds):
    plain_run = []

    def flush():
        if plain_run:
            rows = sorted({r["rows"] for r in plain_run})
            ms = sum(r["wall"] for r in plain_run) / len(plain_run) * 1e3
            print(f"    {len(plain_run)} plain rounds, rows {rows[0]}-{rows[-1]}, {ms:.1f} ms each")
            plain_run.clear()

    for r in rounds:
        if r["kind"] == "plain" and not r["prefills"]:
            plain_run.append(r)
            continue
        flush()
        f = lambda x, n=2: "-" if x is None else f"{x:.{n}f}"  # noqa: E731
        print(f"    {r['kind']}{' +prefill' if r['prefills'] else ''}: rows {r['rows']} (spec {r['spec_rows']}), "
              f"{r['tokens']} tokens, {r['wall'] * 1e3:.1f} ms (forward {r['forward_s'] * 1e3:.1f}, draft "
              f"{r['draft_s'] * 1e3:.1f}, catch-up {r['catch_s'] * 1e3:.1f} on {r['catch_tokens']}); shape "
              f"{r['shape']}, tau* {f(r['tstar'])}, global tau {f(r['global_tau'])}, priced plain "
              f"{f(r['plain_cost'] and r['plain_cost'] * 1e3, 1)} verify {f(r['verify_cost'] and r['verify_cost'] * 1e3, 1)}"
              f" drafting {f(r['drafting_cost'] and r['drafting_cost'] * 1e3, 1)} ms")
    flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load("smollm2-135m-instruct", rl.DRAFTER, "auto", threads=args.threads, compile="auto")
    plain_engine = Engine(engine.target)
    turns = [json.loads(line)["turns"][0] for line in rl.DATA.read_text().splitlines()]
    enc = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
    run(plain_engine, [], enc[-4:], False, 32)
    run(engine, [], enc[-4:], True, 32)
    records = []
    for block in range(args.blocks):
        start = block * (args.requests + args.warm)
        warm = [enc[(start + i) % len(enc)] for i in range(args.warm)]
        prompts = [enc[(start + args.warm + i) % len(enc)] for i in range(args.requests)]
        walls, traces = {}, {}
        for name in (("plain", "drafter") if block % 2 == 0 else ("drafter", "plain")):
            walls[name], traces[name] = run(plain_engine if name == "plain" else engine, warm, prompts,
                                            name == "drafter", args.max_tokens)
        tokens = {n: sum(r["tokens"] for r in traces[n]) for n in walls}
        speed = {n: tokens[n] / walls[n] for n in walls}
        pace = rl.plain_pace(traces["plain"])
        print(f"block {block}: drafter {speed['drafter'] / speed['plain']:.3f}x plain ({speed['drafter']:.1f} against "
              f"{speed['plain']:.1f} tok/s)")
        for kind, row in rl.summary(traces["drafter"], pace).items():
            print(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        print("  plain run's pace, ms per token by rows: "
              + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in sorted(pace.items())))
        show(traces["drafter"])
        sys.stdout.flush()
        records.append({"block": block, "walls": walls, "tokens": tokens, "traces": traces})
    if args.out:
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
