"""The drift fallback's policy replayed offline, without timing noise: how fast would a single stream run
under each policy, on real acceptance and this machine's measured costs?

Greedy speculation is deterministic given where each step starts: a chain of depth d drafted at answer
position i accepts min(A[i], d) tokens, A[i] being how many tokens of the depth-MAX_DEPTH chain drafted there
spell the target's own answer (and T[i] likewise for the 4,4,16 tree). So one pass over each answer (the
target's greedy answer, its features in one forward, a draft at every position) gives every policy's
steps: `--collect` writes those arrays. The costs are the stream monitor's own calibration on this machine
(plain step, verify of N tokens, drafting a chain of d or the tree: medians of timed forwards) and a catch-up
(the drafter reading a plain stretch's features) of `--catch-up` plain steps; or, better, with `--step-costs`,
real whole steps as fallback_trace.py measured them (the calibration's timed forwards leave out each step's
bookkeeping: a chain of 3 cost 1.36 plain steps calibrated, 1.49 in real steps). Each policy is the real
StreamMonitor (decode/fallback.py) driven through the same calls SpeculativeDecoding.run makes, over the
prompts in order in one process, so what it learns carries from prompt to prompt as in `generate`.

    python benchmarks/fallback_sim.py --collect --drafter checkpoints/smollm2-135m-instruct-eagle3 \
        --dtype float32 --threads 2 [--data ../shared/data/eagle_eval/alpaca/question.jsonl] --limit 80 --out traces.json
    python benchmarks/fallback_trace.py ... --fixed 1,1,2 --fixed 1,3,4 --fixed 4,4,16 --out steps.json
    python benchmarks/fallback_sim.py --traces traces.json --step-costs steps.json [--policy NAME ...]

Prints per policy the simulated tokens per plain-step time over the whole set (1.00 = the plain loop), its
median per prompt, its slowest prompt, the plain tokens it spent and its switches; beside it an oracle that
knows each prompt's outcome (per prompt the faster of plain and always speculating with the best fixed
chain); then the same for the traces made to fit half the prompts (every other prompt loses 60 % of its
drafts) and with every acceptance set to 0 (a drafter that never fits: the negative control, which must stay
near 1.00).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from anchorspec.atomic import atomic_write_text  # noqa: E402
from anchorspec.decode.fallback import MAX_CHAIN, TREE_CANDIDATES, StreamMonitor  # noqa: E402
from anchorspec.decode.shape import GREEDY, accepted_length  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

MAX_DEPTH = MAX_CHAIN
TREE = TREE_CANDIDATES[0]


# --- collection (needs the models) ----------------------------------------------------------------------

@torch.inference_mode()
def acceptance_arrays(engine, ids: list[int], max_new_tokens: int) -> dict:
    """The target's greedy answer to `ids`, and at every answer position the accepted length of the
    depth-MAX_DEPTH chain (A) and of the tree (T) drafted there."""
    answer = engine.generate(ids, max_new_tokens=max_new_tokens, speculative=False).token_ids
    target, proposer = engine.target, engine.proposer
    sequence = torch.tensor(ids + list(answer))
    aux = target.forward(sequence, torch.arange(sequence.numel()), target.new_cache(), capture_aux=True).aux
    proposer.reset()
    chain, tree, fed = [], [], 0
    for pos in range(len(ids), sequence.numel() - 1):  # the root: the last committed token
        rest = sequence[pos + 1:].tolist()
        proposer.update(sequence[:pos + 1], aux[fed:pos])
        fed = pos
        chain.append(accepted_length(proposer.propose(TreeShape.chain(min(MAX_DEPTH, len(rest))), GREEDY, None), rest))
        capped = TREE.capped(len(rest))
        tree.append(accepted_length(proposer.propose(capped, GREEDY, None), rest))
    return {"new_tokens": len(answer), "chain": chain, "tree": tree}


def measured_costs(engine) -> dict:
    """The stream monitor's calibration on this machine (seconds): plain, verify(N), draft(d), the tree's draft."""
    monitor = StreamMonitor()
    monitor.calibrate(engine.target, engine.proposer, repeats=15)
    return {"plain": monitor.verify(1), "verify": {n: monitor.verify(n) for n in range(2, MAX_DEPTH + 2)} | {
        TREE.total_tokens: monitor.verify(TREE.total_tokens)},
        "draft": {d: monitor.draft(d) for d in range(1, MAX_DEPTH + 1)},
        "tree_draft": monitor.draft_cost(TREE)}


def collect(args) -> int:
    from anchorspec.api import load
    from bench_core import load_prompts, warn_if_busy
    warn_if_busy(args.threads)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, remember=False)
    prompts = load_prompts(args.data, args.limit, args.every)
    traces = []
    for i, p in enumerate(prompts):
        traces.append({"id": p["id"], **acceptance_arrays(engine, engine.encode(p["text"], chat=True),
                                                           args.max_new_tokens)})
        print(f"{i + 1}/{len(prompts)} chain-8 tau-ish {1 + statistics.fmean(min(a, 3) for a in traces[-1]['chain']):.2f}",
              flush=True)
    costs = measured_costs(engine)
    atomic_write_text(args.out, json.dumps({"drafter": args.drafter, "dtype": str(engine.target.dtype),
                                       "threads": args.threads, "costs": costs, "traces": traces}) + "\n")
    print(f"wrote {args.out}")
    return 0


# --- simulation ---------------------------------------------------------------------------------------

class Clock:
    """What a step of each kind costs (seconds): the calibration's (plain, verify(N), draft(d)), or with
    `steps` (fallback_trace.py's step_costs: real whole steps per shape, the plain step, the catch-up) real
    steps, each split into drafting and verifying in the calibration's proportions; chains not measured
    are interpolated by depth (extrapolated past the deepest)."""

    def __init__(self, costs: dict, catch_up: float, steps: dict | None = None, noise: float = 0.0, seed: int = 0):
        self.noise, self.rng = noise, random.Random(seed)  # each step's time times a lognormal of this spread
        self.plain = costs["plain"]
        verify = {int(k): v for k, v in costs["verify"].items()}
        draft = {int(k): v for k, v in costs["draft"].items()}
        self.whole = {d: draft[d] + verify[d + 1] for d in draft}  # chain depth -> step seconds
        self.tree = costs["tree_draft"] + verify[TREE.total_tokens]
        self.draft_share = {d: draft[d] / self.whole[d] for d in draft}
        self.tree_share = costs["tree_draft"] / self.tree
        self.catch_up = catch_up * self.plain  # the drafter reading a plain stretch: a fraction of a plain step
        if steps:
            self.plain, measured = steps["plain"], {}
            for key, seconds in steps["shapes"].items():
                shape = TreeShape.parse(key)
                if shape.is_chain:
                    measured[shape.depth] = seconds
                elif shape == TREE:
                    self.tree = seconds
            known = sorted(measured)
            for d in self.whole:
                lo = max((k for k in known if k <= d), default=None)
                hi = min((k for k in known if k >= d), default=None)
                if lo is not None and hi is not None:
                    self.whole[d] = measured[lo] if lo == hi else measured[lo] + (measured[hi] - measured[lo]) * (d - lo) / (hi - lo)
                elif len(known) >= 2:  # past the measured depths: the last two measured set the slope
                    a, b = (known[:2] if hi is not None else known[-2:])
                    self.whole[d] = measured[a] + (measured[b] - measured[a]) * (d - a) / (b - a)
            self.catch_up = steps.get("catch_up", self.catch_up)

    def step(self, shape: TreeShape, depth: int, caught_up: bool) -> tuple[float, float]:
        """(step seconds, of which drafting) of a `depth`-deep step of `shape`."""
        whole, share = (self.whole[depth], self.draft_share[depth]) if shape.is_chain else (self.tree, self.tree_share)
        extra = self.catch_up if caught_up else 0.0
        jitter = self.jitter()
        return (whole + extra) * jitter, (whole * share + extra) * jitter

    def jitter(self) -> float:
        return math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0


def run_stream(monitor: StreamMonitor, traces: list[dict], clock: Clock, shape: TreeShape | None = None,
               trees=(TREE,), max_new_tokens: int = 128) -> list[dict]:
    """Every trace in order through `monitor` as SpeculativeDecoding.run drives it; `shape` fixed, or None:
    chosen per prompt as Engine.shape does (choose_shape, kept unless another is clearly faster), with explore
    steps. Returns per prompt the simulated seconds, tokens, plain tokens and switches."""
    out, current = [], None
    monitor.calibrated = True
    for trace in traces:
        if shape is None:
            current, _ = monitor.choose_shape(current=current, trees=trees)
        stream_shape = shape or current
        state = monitor.start(stream_shape)
        seconds, tokens, plain_tokens, previous = clock.plain, 1, 0, "prefill"  # the prefill's first token
        budget = min(trace["new_tokens"], max_new_tokens)
        i = 0  # the answer position of the step's root
        while tokens < budget:
            monitor.start_round([state])
            explored = monitor.explore(stream_shape, trees) if shape is None and state.speculating else None
            step_shape = (explored or stream_shape).capped(budget - tokens - 1) if state.speculating else None
            if step_shape is None:
                step_s, kind, accepted, depth, draft_s, drafted = clock.plain * clock.jitter(), "plain", 0, 0, 0.0, 0
                plain_tokens += 1
            else:
                kind, depth = "speculative", step_shape.depth
                reach = trace["chain"][i] if step_shape.is_chain else trace["tree"][i]
                accepted = min(reach, depth)
                step_s, draft_s = clock.step(step_shape, depth, previous != "speculative")
                drafted = step_shape.total_tokens - 1
            top = min(trace["chain"][i], step_shape.depth) if step_shape is not None and not step_shape.is_chain else None
            monitor.observe_step(kind, drafted + 1, depth, accepted, step_s, draft_s,
                                 catch_up=previous != "speculative", top_ranked=top,
                                 top_depth=step_shape.depth if top is not None else None,
                                 shape=explored or stream_shape)
            made = min(accepted + 1, budget - tokens)
            monitor.record(state, kind, accepted, made)
            seconds, tokens, i, previous = seconds + step_s, tokens + made, i + made, kind
        out.append({"id": trace["id"], "seconds": seconds, "tokens": tokens, "plain_tokens": plain_tokens,
                    "switches": state.switches, "shape": str(stream_shape)})
    return out


MONITOR_ARGS = ("window", "min_steps", "retry_after", "global_window", "global_min_steps", "max_retry_after")


def _monitor(**attrs):
    """A StreamMonitor factory with `attrs` set: constructor arguments, or attributes set after."""
    def make():
        m = StreamMonitor(**{k: v for k, v in attrs.items() if k in MONITOR_ARGS})
        for k, v in attrs.items():
            if k not in MONITOR_ARGS:
                setattr(m, k, v)
        return m
    return make


POLICIES = {  # variants of the default monitor, for --policy
    "alone": _monitor(prior_steps=0),  # a window judged on its own: the rule before session 56
    "prior4": _monitor(prior_steps=4),
    "prior16": _monitor(prior_steps=16),
    "se0": _monitor(standard_errors=0.0),
    "se2": _monitor(standard_errors=2.0),
    "min16": _monitor(min_steps=16),
    "retry16": _monitor(retry_after=16),
    "retry64": _monitor(retry_after=64),
    "no-gate": _monitor(global_min_steps=10**9, global_window=10**9),
    "margin0": _monitor(shape_margin=0.0),
    "margin2": _monitor(shape_margin=0.02),
    "margin10": _monitor(shape_margin=0.10),
}


def summarise(name: str, runs: list[dict], clock: Clock) -> dict:
    speed = [r["tokens"] / r["seconds"] * clock.plain for r in runs]  # tokens per plain-step time
    total = sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs) * clock.plain
    return {"policy": name, "total": total, "median": statistics.median(speed), "min": min(speed),
            "plain_tokens": sum(r["plain_tokens"] for r in runs), "switches": sum(r["switches"] for r in runs)}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", help="with --collect: the drafter checkpoint")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="", help="--collect: where the traces go; else where the table goes (JSON)")
    p.add_argument("--collect", action="store_true", help="run the models and write the traces to --out")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench"
                                         / "question.jsonl"))
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--traces", help="traces written by --collect")
    p.add_argument("--catch-up", type=float, default=0.25,
                   help="a catch-up's extra cost, in plain steps (without --step-costs)")
    p.add_argument("--policy", action="append", default=[], choices=sorted(POLICIES),
                   help="also a variant of the default monitor (repeatable)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="each step's time times exp(N(0, NOISE)): a host's step-to-step spread (0: exact costs)")
    p.add_argument("--step-costs", help="fallback_trace.py's JSON: its real steps' costs instead of the calibration's")
    args = p.parse_args(argv)
    if args.collect:
        return collect(args)
    data = json.loads(Path(args.traces).read_text())
    steps = json.loads(Path(args.step_costs).read_text())["step_costs"] if args.step_costs else None
    clock = Clock(data["costs"], args.catch_up, steps, args.noise)
    traces = data["traces"]
    zero = [{**t, "chain": [0] * len(t["chain"]), "tree": [0] * len(t["tree"])} for t in traces]
    # a weaker drafter: on every other prompt (a workload it fits half the time), each draft rejected outright
    # with probability 0.6 (seeded): around the break-even
    rng = random.Random(0)
    weak = []
    for j, t in enumerate(traces):
        lost = [j % 2 == 1 and rng.random() < 0.6 for _ in t["chain"]]
        weak.append({**t, "chain": [0 if x else a for a, x in zip(t["chain"], lost)],
                     "tree": [0 if x else a for a, x in zip(t["tree"], lost)]})
    rows = []
    for label, ts in (("drafter", traces), ("fits half the prompts", weak), ("never fits", zero)):
        results = {"default": run_stream(StreamMonitor(), ts, clock, max_new_tokens=args.max_new_tokens)}
        for name in args.policy:
            results[name] = run_stream(POLICIES[name](), ts, clock, max_new_tokens=args.max_new_tokens)
        for d in (2, 3, 4):
            results[f"always chain {d}"] = run_stream(StreamMonitor(enabled=False), ts, clock,
                                                      TreeShape.chain(d), max_new_tokens=args.max_new_tokens)
        results["plain"] = [{"id": t["id"], "seconds": clock.plain * min(t["new_tokens"], args.max_new_tokens),
                             "tokens": min(t["new_tokens"], args.max_new_tokens), "plain_tokens": 0, "switches": 0}
                            for t in ts]
        best = max((k for k in results if k.startswith("always")),
                   key=lambda k: summarise(k, results[k], clock)["total"])
        results["oracle"] = [min(a, b, key=lambda r: r["seconds"]) for a, b in zip(results[best], results["plain"])]
        print(f"\n{label}: {len(ts)} prompts, {data['dtype']}, {data['threads']} threads, drafter {data['drafter']}")
        print(f"{'policy':18s} {'all':>6s} {'median':>7s} {'slowest':>8s} {'plain tok':>9s} {'switches':>8s}")
        for name, runs in results.items():
            s = summarise(name, runs, clock)
            rows.append({"traces": label, **s})
            print(f"{name:18s} {s['total']:6.3f} {s['median']:7.3f} {s['min']:8.3f} {s['plain_tokens']:9d} "
                  f"{s['switches']:8d}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"costs": data["costs"], "catch_up": args.catch_up, "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
