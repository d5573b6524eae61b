"""Why `generate`'s defaults run at the speed they do: every step of the default engine traced (kind, shape,
time, accepted length, the monitor's tau* and the tau it judged the window on at each switch), beside the same drafter
forced to fixed shapes with the fallback off (their whole steps' median times: the costs
`fallback_sim.py --step-costs` replays policies with), and the plain loop, methods rotated per prompt in one process.

    python benchmarks/fallback_trace.py --drafter checkpoints/smollm2-135m-instruct-eagle3 --dtype float32 \
        --limit 10 --threads 2 [--fixed 1,3,4 ...] [--alone] --out FILE.json

Prints per prompt each method's tokens/s, then for the default engine: the plain tokens spent, why (switches
off with the window's mean, judged tau and tau* at that moment; new prompts started plain; retries skipped as
futile), the median cost of each step kind against the plain loop's, and the monitor's own estimates at the
end. No costs are read from or written to earlier runs (`remember=False`): a fresh machine's first run.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.fallback import shape_key  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from bench_core import drafter_parser, in_turns, load_prompts, median, timed, warn_if_busy, write_results  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"


def trace_monitor(monitor, events: list) -> None:
    """Record every step the monitor is told of and every decision it takes, into `events`."""
    record, observe, start = monitor.record, monitor.observe_step, monitor.start

    def traced_record(state, kind, accepted=0, tokens=1):
        verdict = record(state, kind, accepted, tokens)
        if verdict == "off":  # the window it was judged on is still there
            events.append({"event": "off", "mean": state.rolling_tau, "judged": monitor.judged_tau(state),
                           "tstar": monitor.threshold, "global": monitor.global_tau, "n": len(state.window)})
        return verdict

    def traced_observe(kind, tokens, depth, accepted, step_s, draft_s, catch_up=False, top_ranked=None,
                       top_depth=None, shape=None, lookup_accepted=0):
        events.append({"event": "step", "kind": kind, "tokens": tokens, "accepted": accepted,
                       "lookup_accepted": lookup_accepted, "step_s": step_s, "draft_s": draft_s, "catch_up": catch_up,
                       "shape": shape_key(shape) if shape is not None and kind == "speculative" else None})
        observe(kind, tokens, depth, accepted, step_s, draft_s, catch_up, top_ranked, top_depth, shape, lookup_accepted)

    def traced_start(shape, sampling=None):
        state = start(shape, sampling)
        events.append({"event": "start", "shape": shape_key(shape), "regime": monitor.regime, "speculating": state.speculating,
                       "tstar": monitor.threshold, "global": monitor.global_tau})
        return state

    monitor.record, monitor.observe_step, monitor.start = traced_record, traced_observe, traced_start


def main(argv=None) -> int:
    p = drafter_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--fixed", action="append", default=None, metavar="TOP_K,DEPTH,TOTAL",
                   help="a fixed shape drafted at every step (fallback off), repeatable (default: 1,3,4)")
    p.add_argument("--alone", action="store_true",
                   help="also the default engine judging each window on its own (prior_steps 0: before session 56)")
    args = p.parse_args(argv)
    args.fixed = args.fixed or ["1,3,4"]
    warn_if_busy(args.threads)
    prompts = load_prompts(args.data, args.limit, args.every)

    def engine(drafter=None, **kw):
        return load(args.target, drafter, args.dtype, threads=args.threads, remember=False, **kw)

    plain, default = engine(), engine(args.drafter)
    events: list[dict] = []
    trace_monitor(default.monitor, events)
    methods = {"plain": (plain, {"speculative": False}), "default": (default, {})}
    if args.alone:  # the rule before session 56: the window judged on its own
        alone = engine(args.drafter)
        alone.monitor.prior_steps = 0
        methods["default, window alone"] = (alone, {})
    fixed_events: dict[str, list[dict]] = {}
    for text in args.fixed:  # a disabled monitor still learns: its steps are traced the same way
        fixed = engine(args.drafter, shape=TreeShape.parse(text), fallback=False)
        trace_monitor(fixed.monitor, fixed_events.setdefault(text, []))
        methods[f"fixed {text}"] = (fixed, {})
    print(f"dtype {default.target.dtype}, threads {args.threads}", flush=True)
    rows: dict[str, list[dict]] = {name: [] for name in methods}
    for i, prompt in enumerate(prompts):
        ids = default.encode(prompt["text"], chat=True)
        for name in in_turns(list(methods), i):
            eng, kwargs = methods[name]
            if name == "default":
                events.append({"event": "prompt", "index": i, "shape": shape_key(eng.shape)})
            res, seconds = timed(eng.generate, ids, max_new_tokens=args.max_new_tokens, **kwargs)
            rows[name].append({"id": prompt["id"], "tokens": len(res.token_ids), "seconds": seconds,
                               "tok_s": len(res.token_ids) / seconds,
                               "tau": res.stats.tau if res.stats.verify_steps else None})
        print(i, {n: round(r[-1]["tok_s"], 1) for n, r in rows.items()}, flush=True)

    steps = [e for e in events if e["event"] == "step"]
    plain_step = median([r["seconds"] / r["tokens"] for r in rows["plain"]])
    by_kind: dict[str, list[float]] = {}
    for e in steps:
        key = "plain" if e["kind"] == "plain" else f"spec {e['shape']}" + (" catch-up" if e["catch_up"] else "")
        by_kind.setdefault(key, []).append(e["step_s"])
    summary = {name: {"median_tok_s": median([r["tok_s"] for r in rs]),
                      "total_tok_s": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)}
               for name, rs in rows.items()}
    for name in summary:
        summary[name]["vs_plain_total"] = summary[name]["total_tok_s"] / summary["plain"]["total_tok_s"]
    offs = [e for e in events if e["event"] == "off"]
    starts = Counter((e["speculating"]) for e in events if e["event"] == "start")
    step_costs = {"plain": statistics.median(by_kind["plain"]) if "plain" in by_kind else plain_step, "shapes": {}}
    for text, evs in fixed_events.items():
        steady = [e["step_s"] for e in evs if e["event"] == "step" and e["kind"] == "speculative" and not e["catch_up"]
                  and e["tokens"] == TreeShape.parse(text).total_tokens]
        if steady:
            step_costs["shapes"][shape_key(TreeShape.parse(text))] = statistics.median(steady)
    # the drafter reading a stretch's features first: the default engine's catch-up steps against its steady ones,
    # of the shape it drafted most (a fixed engine catches up only on the prompt, a longer read)
    main = Counter(e["shape"] for e in steps if e["kind"] == "speculative").most_common(1)
    if main and by_kind.get(f"spec {main[0][0]} catch-up") and by_kind.get(f"spec {main[0][0]}"):
        step_costs["catch_up"] = (statistics.median(by_kind[f"spec {main[0][0]} catch-up"])
                                  - statistics.median(by_kind[f"spec {main[0][0]}"]))
    report = {
        "summary": summary,
        "step_costs": step_costs,
        "plain_loop_s_per_token": plain_step,
        "default_steps": {k: {"n": len(v), "median_s": statistics.median(v), "over_plain_loop": statistics.median(v) / plain_step}
                          for k, v in sorted(by_kind.items())},
        "default_plain_tokens": sum(e["tokens"] for e in steps if e["kind"] == "plain"),
        "default_spec_steps": sum(e["kind"] == "speculative" for e in steps),
        "switches_off": offs,
        "prompts_started_plain": starts.get(False, 0),
        "probes_skipped": default.monitor.probes_skipped,
        "estimates": default.monitor.estimates(),
        "threshold_end": default.monitor.threshold,
    }
    print("\nmethod                 median tok/s   all tokens / all seconds   vs plain")
    for name, s in summary.items():
        print(f"{name:22s} {s['median_tok_s']:12.1f}   {s['total_tok_s']:24.1f}   {s['vs_plain_total']:.2f}x")
    print(f"\ndefault: {report['default_spec_steps']} speculative steps, {report['default_plain_tokens']} plain tokens; "
          f"{len(offs)} switches off, {report['prompts_started_plain']} prompts started plain, "
          f"{report['probes_skipped']} retries skipped as futile")
    for e in offs:
        print(f"  off: window {e['n']} mean {e['mean']:.2f} judged {e['judged']:.2f} tau* {e['tstar']:.2f} "
              f"global {e['global']:.2f}")
    print("step kinds (median seconds, over the plain loop's per-token time):")
    for k, v in report["default_steps"].items():
        print(f"  {k:28s} n={v['n']:4d}  {v['median_s'] * 1e3:6.1f} ms  {v['over_plain_loop']:.2f}x")
    print("monitor estimates at the end (tau, cost over plain, speedup):")
    for k, v in report["estimates"].items():
        print(f"  {k:10s} tau {v['tau']:.2f}  cost {v['cost'] or float('nan'):.2f}  speedup {v['speedup'] or float('nan'):.2f}")
    print("fixed shapes' steps (median, whole step):", {k: round(v * 1e3, 1) for k, v in step_costs["shapes"].items()},
          f"plain {step_costs['plain'] * 1e3:.1f} ms, catch-up +{step_costs.get('catch_up', float('nan')) * 1e3:.1f} ms")
    write_results(args.out, args, {"rows": rows, "events": events, **report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
