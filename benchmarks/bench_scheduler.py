"""The server's scheduler under a closed-loop load, in one process, without HTTP: where a drafter
server's time goes against a plain server's.

    python benchmarks/bench_scheduler.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        [--users 16] [--requests 48] [--max-tokens 128] [--repeats 2] [--dtype auto] [--threads 1]

Three schedulers (`anchorspec serve`'s own `Scheduler`, rounds driven from this thread): a plain
server, a drafter server (calibrated as `serve` does), and a plain server on the drafter server's
target (the same weights in memory: the control for where the weights live). Each keeps `--users`
requests running (MT-bench first turns, chat template, T=0) until `--requests` were served; the
three alternate per repeat, so load on the machine hits them alike. Printed: output tokens/s per
repeat, and per server the rounds split by kind (plain, speculative, with prefills) with their
wall time, drafting and target-forward time, the plain rounds' milliseconds per row, and when the
drafter server speculated (round index, rows, drafting rows, drafting and wall seconds; "apart": a
probe whose few speculating rows ran in a forward of their own beside the plain rows'). The HTTP load test
(`load_test.py`) measures what a client sees; this one says why, with less run-to-run noise.
CPU model, flags, torch version, threads and dtype are printed with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import DEFAULT_DATA, environment, load_prompts, model_parser, warn_if_busy  # noqa: E402

from anchorspec.api import Engine, load  # noqa: E402
from anchorspec.serve.scheduler import Scheduler  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = model_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--users", type=int, default=16, help="requests kept running at once")
    p.add_argument("--requests", type=int, default=48, help="requests served per repeat")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


class Recorder:
    """Wraps a scheduler's BatchDecoder.round to keep each round's sizes and times."""

    def __init__(self, scheduler: Scheduler):
        self.rounds: list[dict] = []
        real = scheduler.decoder.round

        def timed(items, split=False):
            t = time.perf_counter()
            result = real(items, split)
            self.rounds.append({"rows": result.rows, "width": result.width, "prefills": result.prefills,
                                "draft_s": result.draft_s, "forward_s": result.forward_s,
                                "wall_s": time.perf_counter() - t, "split": len(result.forwards) > 1,
                                "drafting_rows": result.draft_rows})
            return result

        scheduler.decoder.round = timed


def serve_load(scheduler: Scheduler, prompts: list[list[int]], args, loop) -> tuple[float, float]:
    """Closed loop: `users` requests running, a new one submitted as each finishes. (seconds, tokens)."""
    submitted = 0

    def submit():
        nonlocal submitted
        scheduler.submit(prompts[submitted % len(prompts)], args.max_tokens, 0.0, loop=loop)
        submitted += 1

    for _ in range(min(args.users, args.requests)):
        submit()
    registry = scheduler.metrics.registry

    def generated() -> float:
        return registry.get_sample_value("anchorspec_generated_tokens_total") or 0.0

    tokens0, t = generated(), time.perf_counter()
    def active() -> int:
        return scheduler.running_count + scheduler.waiting_count

    while active():
        before = active()
        scheduler.step()
        for _ in range(before - active()):  # a new request for each one that finished
            if submitted < args.requests:
                submit()
    return time.perf_counter() - t, generated() - tokens0


def summarise(rounds: list[dict]) -> dict:
    kinds = defaultdict(lambda: {"rounds": 0, "wall_s": 0.0, "draft_s": 0.0, "forward_s": 0.0})
    for r in rounds:
        kind = "prefill" if not r["rows"] else ("plain" if r["width"] == 1 else
                                                 "speculative, apart" if r.get("split") else "speculative")
        kind += "+prefill" if r["prefills"] and r["rows"] else ""
        for key in ("wall_s", "draft_s", "forward_s"):
            kinds[kind][key] += r[key]
        kinds[kind]["rounds"] += 1
    plain = [r for r in rounds if r["rows"] and r["width"] == 1 and not r["prefills"]]
    return {"kinds": dict(kinds),
            "plain_ms_per_row": 1000 * sum(r["wall_s"] for r in plain) / max(1, sum(r["rows"] for r in plain)),
            "speculative_rounds": [(i, r["rows"], r.get("drafting_rows", r["rows"]), round(r["draft_s"], 3),
                                    round(r["wall_s"], 3)) for i, r in enumerate(rounds) if r["width"] > 1]}


def main(argv=None) -> None:
    args = parse_args(argv)
    warn_if_busy(args.threads)
    drafter = load(args.target, args.drafter, dtype=args.dtype, threads=args.threads)
    plain = load(args.target, dtype=args.dtype, threads=args.threads)
    env = environment(args)  # after load: it reads the thread count load set
    print(json.dumps(env))
    servers = {"plain": plain, "drafter": drafter, "plain, drafter server's target": Engine(drafter.target)}
    texts = [p["text"] for p in load_prompts(args.data, 80)]
    loop = asyncio.new_event_loop()  # handles queue their events on it; nobody reads them
    runs = {}
    for name, engine in servers.items():
        scheduler = Scheduler(engine, max_running=args.users, calibrate=False)
        if scheduler.speculative:
            scheduler.calibrate()  # what `serve` does before it takes requests
        runs[name] = (scheduler, Recorder(scheduler), [engine.encode(t, chat=True) for t in texts], [])
    print(f"dtype {drafter.target.dtype}, {args.users} users, {args.requests} requests of {args.max_tokens} tokens")
    for rep in range(args.repeats):
        for name, (scheduler, _, prompts, tok_s) in runs.items():
            seconds, tokens = serve_load(scheduler, prompts, args, loop)
            tok_s.append(tokens / seconds)
            print(f"repeat {rep}  {name:32s} {tokens:6.0f} tokens in {seconds:6.2f} s = {tok_s[-1]:6.1f} tok/s", flush=True)
    out = {"environment": env, "servers": {}}
    for name, (_, recorder, _, tok_s) in runs.items():
        summary = summarise(recorder.rounds)
        out["servers"][name] = {"tok_s": tok_s, **summary}
        print(f"\n{name}: {' '.join(f'{x:.1f}' for x in tok_s)} tok/s; plain rounds {summary['plain_ms_per_row']:.2f} ms a row")
        for kind, k in sorted(summary["kinds"].items()):
            print(f"  {kind:22s} {k['rounds']:5d} rounds  {k['wall_s']:7.2f} s  (drafting {k['draft_s']:.2f}, "
                  f"forward {k['forward_s']:.2f})")
        if summary["speculative_rounds"]:
            print("  speculative rounds (index, rows, drafting rows, drafting s, wall s):", summary["speculative_rounds"])
    base = runs["plain"][3]
    ratios = [d / p for d, p in zip(runs["drafter"][3], base)]
    print(f"\ndrafter / plain server, per repeat: {' '.join(f'{r:.3f}x' for r in ratios)}")
    out["drafter_over_plain"] = ratios
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
