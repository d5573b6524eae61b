"""`generate`'s default shape choice, measured: the shape the costs choose now (chains and EAGLE's
4,4,16 tree) against the chains-only choice of sessions 22-38, the same choice without the fallback,
fixed shapes, HF `generate` and the project's plain loop, on the same prompts, methods rotated per
prompt in one process. Each engine keeps its own monitor (its costs and acceptance accumulate over the
prompts, as in one process); none reads or writes the costs earlier runs kept (`remember=False`), so
every run starts as a fresh machine does.

    python benchmarks/bench_default_shape.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --every 5 --limit 16 --threads 2 [--random-drafter DIR] [--shape 2,3,6 ...] [--temperature 1] [--compile]
        [--mean-rule] [--plain-twice] [--chains-only] [--lookup 16] [--no-lookup] --out FILE.json

Prints per prompt the tokens/s and the shape each default engine drafted with, then per method: median
tokens/s, median and mean per-prompt speed over the plain loop (and over HF), the slowest prompt, tau
and fallback switches. CPU model, flags, torch version, threads and dtype go with the figures.
The default stream's record says why it drafted what it did: per prompt, the estimates its shape was
chosen on (tau, cost and speedup of each candidate) and every step as its monitor observed it ("trace");
the summary prices each shape it drafted from those steps against the plain loop's ("realised"), beside
what the estimates predicted for the same steps ("estimated").
`--plain-twice` runs the plain loop a second time as its own method ("plain again"): its per-prompt
ratios over "plain" are the noise floor the other methods' slowest prompt is read against (a method
that cannot be slower than plain still shows its slowest prompt at about that floor).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorspec.api import Engine, load  # noqa: E402
from anchorspec.decode.fallback import shape_key  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from anchorspec.decode.sampling import SamplingParams  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.models.target import stock_twin  # noqa: E402
from bench_core import (drafter_parser, hf_generate, in_turns, load_prompts, median, timed,  # noqa: E402
                        warn_if_busy, write_results)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"


def main(argv=None) -> int:
    p = drafter_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--every", type=int, default=5, help="every N-th prompt (MT-bench: 5 takes 2 of each category)")
    p.add_argument("--shape", action="append", default=[], metavar="TOP_K,DEPTH,TOTAL",
                   help="also a fixed shape (fallback on), repeatable")
    p.add_argument("--random-drafter", help="also the default path with this (untrained) drafter")
    p.add_argument("--lookup", type=int, action="append", default=[], metavar="TOKENS",
                   help="also the default path with a context-lookup chain of up to TOKENS (its own engine and "
                        "monitor), repeatable")
    p.add_argument("--no-lookup", action="store_true",
                   help="also the default path without the context-lookup chain (its own engine and monitor)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (the slowest method)")
    p.add_argument("--compile", action="store_true", help="every engine with load(compile=True) (HF stays stock)")
    p.add_argument("--mean-rule", action="store_true",
                   help="also the default path switching off on the window's mean (the rule before session 46)")
    p.add_argument("--chains-only", action="store_true",
                   help="also the pre-session-39 choice among chains only (it passes its shape each prompt, so its "
                        "monitor never learns deeper acceptance: it stays on the chain it starts on)")
    p.add_argument("--plain-twice", action="store_true",
                   help="also the plain loop again, as a method of its own: the per-prompt noise floor")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the project's methods at this temperature, seeded per prompt (HF stays greedy)")
    args = p.parse_args(argv)
    warn_if_busy(args.threads)
    prompts = load_prompts(args.data, args.limit, args.every)

    def engine(drafter=None, **kw):
        return load(args.target, drafter, args.dtype, threads=args.threads, remember=False, compile=args.compile, **kw)

    plain = engine()
    default = engine(args.drafter)
    methods = {"plain": (plain, {"speculative": False}), "default": (default, {}),
               "no-fallback": (engine(args.drafter, fallback=False), {})}
    if args.chains_only:  # its shape is chosen among chains only, as before session 39
        methods["chains-only"] = (engine(args.drafter), None)
    if args.plain_twice:
        methods["plain again"] = (plain, {"speculative": False})
    for text in args.shape:
        methods[text] = (default, {"shape": TreeShape.parse(text)})
    if args.mean_rule:
        mean_rule = engine(args.drafter)
        mean_rule.monitor.standard_errors = 0.0
        methods["mean-rule"] = (mean_rule, {})
    if args.random_drafter:
        methods["random"] = (engine(args.random_drafter), {})
    for tokens in args.lookup:
        methods[f"lookup{tokens}"] = (engine(args.drafter), {"lookup": LookupSettings(tokens)})
    if args.no_lookup:
        methods["no-lookup"] = (engine(args.drafter), {"lookup": None})
    stock = None if args.no_hf else Engine(stock_twin(plain.target, args.target, plain.target.dtype))
    if stock is not None:
        methods = {"hf": (stock, None), **methods}
    print(f"dtype {default.target.dtype}, threads {args.threads}; default shape {default.shape} ({default.shape_source})",
          flush=True)
    steps: list[dict] = []  # the default stream's steps, as its monitor observed them (row "trace")
    observe = default.monitor.observe_step if default.monitor is not None else None

    def traced(kind, tokens, depth, accepted, step_s, draft_s, catch_up=False, top_ranked=None, top_depth=None,
               shape=None, lookup_accepted=0):
        # "accepted": every accepted token of the step (the lookup chain's too); the monitor learns from the drafter's
        steps.append({"kind": kind, "tokens": tokens, "depth": depth, "accepted": accepted + lookup_accepted,
                      "drafter_accepted": accepted, "step_s": step_s, "draft_s": draft_s, "catch_up": catch_up,
                      "shape": shape_key(shape) if shape is not None else None})
        observe(kind, tokens, depth, accepted, step_s, draft_s, catch_up, top_ranked, top_depth, shape, lookup_accepted)

    if observe is not None:
        default.monitor.observe_step = traced
    chains_only_shape = None  # the chain that engine drafts with, kept unless another is clearly faster
    rows: dict[str, list[dict]] = {name: [] for name in methods}
    for i, prompt in enumerate(prompts):
        ids = default.encode(prompt["text"], chat=True)
        for name in in_turns(list(methods), i):
            eng, kwargs = methods[name]
            if name == "hf":
                out, seconds = timed(hf_generate, eng, ids, args.max_new_tokens)
                rows[name].append({"id": prompt["id"], "tok_s": len(out) / seconds})
                continue
            if name == "chains-only":
                if not eng.monitor.calibrated:
                    eng.monitor.calibrate(eng.target, eng.proposer)
                chains_only_shape, _ = eng.monitor.choose_shape(trees=(), current=chains_only_shape)
                kwargs = {"shape": chains_only_shape}
            sampling = {"temperature": args.temperature, "seed": i} if args.temperature > 0 else {}
            drafts = eng.monitor is not None and kwargs.get("speculative", True)
            shape = kwargs.get("shape") or (eng.shape_for(SamplingParams(args.temperature)) if drafts else None)
            # what the stream chose its shape on: each candidate's expected tau, cost over a plain step and rank
            estimates = eng.monitor.estimates() if drafts and eng.monitor.calibrated else None
            # the plain step those estimates divide by, in seconds now (stored costs are divided by the pace)
            plain_unit = eng.monitor.verify(1) if estimates else None
            plain_estimate = plain_unit * eng.monitor.pace() if plain_unit else None
            steps.clear()
            res, seconds = timed(eng.generate, ids, max_new_tokens=args.max_new_tokens, **sampling, **kwargs)
            stats = res.stats
            rows[name].append({"id": prompt["id"], "tok_s": len(res.token_ids) / seconds,
                               "shape": shape_key(shape) if shape is not None else None,
                               "tau": stats.tau if stats.verify_steps else None,
                               "switches": stats.fallback_switches, "explored": stats.explored_steps,
                               "lookup_rows": stats.lookup_rows, "lookup_tokens": stats.lookup_tokens,
                               # the realised costs, against which the estimates can be checked
                               "steps": stats.target_forwards, "verify_steps": stats.verify_steps,
                               "seconds": {"prefill": stats.prefill_s, "draft": stats.draft_s,
                                           "verify": stats.verify_s, "total": stats.total_s},
                               "estimates": estimates, "plain_estimate_s": plain_estimate, "tokens": res.token_ids})
            if eng is default and not kwargs:
                rows[name][-1]["trace"] = list(steps)
        print(i, {n: (round(r[-1]["tok_s"], 1), r[-1].get("shape")) for n, r in rows.items()}, flush=True)
    summary = {}
    for name, rs in rows.items():
        entry = {"median_tok_s": median([r["tok_s"] for r in rs])}
        for base in ("plain", "hf"):
            if base in rows:
                ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, rows[base])]
                entry[f"vs_{base}"] = {"median": median(ratios), "mean": statistics.mean(ratios), "min": min(ratios)}
        taus = [r["tau"] for r in rs if r.get("tau")]
        entry["tau"] = statistics.mean(taus) if taus else None
        entry["switches"] = sum(r.get("switches") or 0 for r in rs)
        entry["shapes"] = sorted({r["shape"] for r in rs if r.get("shape")})
        summary[name] = entry
        vs = entry.get("vs_plain", {})
        hf = entry.get("vs_hf", {})
        print(f"{name:12s} {entry['median_tok_s']:6.1f} tok/s  vs plain {vs.get('median', 1):.2f}x median, "
              f"{vs.get('mean', 1):.2f}x mean, slowest {vs.get('min', 1):.2f}x"
              + (f"; vs HF {hf['median']:.2f}x" if hf else "")
              + (f"; tau {entry['tau']:.2f}" if entry["tau"] else "")
              + f"; switches {entry['switches']}; shapes {','.join(entry['shapes']) or '-'}")
    if default.monitor is not None:
        m = default.monitor
        summary["default_monitor"] = {"trees": m.trees, "tree_ratio": {k: m.tree_ratio(TreeShape.parse(k)) for k in m.trees},
                                      "acceptance": [m.acceptance(d) for d in range(1, 7)],
                                      "realised": realised_by_shape(rows["default"], rows["plain"])}
        plain_estimates = [r["plain_estimate_s"] for r in rows["default"] if r.get("plain_estimate_s")]
        if plain_estimates and "plain" in rows:  # the denominator of the cost ratios
            loop_s = plain_step_s(rows["plain"])
            summary["default_monitor"]["plain_step_ms"] = {"estimated": 1e3 * median(plain_estimates),
                                                           "plain_loop": 1e3 * loop_s}
            print(f"the plain step the estimates divide by: {1e3 * median(plain_estimates):.1f} ms (median at the "
                  f"prompts' starts); the plain loop's: {1e3 * loop_s:.1f} ms a token")
        for key, r in summary["default_monitor"]["realised"].items():
            est = r.get("estimated")
            print(f"default's steps drafted {key:8s}: {r['steps']:5d} steps, tau {r['tau']:.2f}, "
                  f"{r['step_ms']:.1f} ms a step ({r['draft_ms']:.1f} drafting) = {r['cost']:.2f} plain steps, "
                  f"{r['speedup']:.2f}x plain"
                  + (f" (estimated: tau {est['tau']:.2f}, {est['cost']:.2f} plain steps, {est['speedup']:.2f}x)"
                     if est else ""))
    write_results(args.out, args, {"summary": summary, "rows": rows})
    return 0


def plain_step_s(plain_rows: list[dict]) -> float:
    """The plain loop's decoding time per token after the prefill, median over prompts."""
    return median([(r["seconds"]["total"] - r["seconds"]["prefill"]) / (len(r["tokens"]) - 1)
                   for r in plain_rows if len(r["tokens"]) > 1])


def realised_by_shape(rows: list[dict], plain_rows: list[dict]) -> dict[str, dict[str, float]]:
    """What the default stream's steps (row "trace") cost and yielded, per shape drafted (explored steps under
    their own shape), against a step of the plain loop (`plain_rows`: its decoding time per token after the
    prefill, median over prompts): the figures its estimates (row "estimates") predict. Steps right after a
    plain stretch (catch_up) are left out, as the monitor leaves out their drafting time. "estimated" is what
    the estimates said of the same steps: each prompt's figures for the shape, weighted by its steps of it."""
    def counted(step: dict, key: str) -> bool:  # a speculative step of shape `key` whose costs are its own
        return step["kind"] == "speculative" and step["shape"] == key and not step["catch_up"]

    steps = [s for row in rows for s in row.get("trace", ())]
    plain_s = plain_step_s(plain_rows)
    out = {}
    for key in sorted({s["shape"] for s in steps if s["kind"] == "speculative"}):
        mine = [s for s in steps if counted(s, key)]
        if not mine:
            continue
        tau = statistics.fmean(s["accepted"] + 1 for s in mine)
        step_s = median([s["step_s"] for s in mine])
        out[key] = {"steps": len(mine), "tau": tau, "step_ms": 1e3 * step_s,
                    "draft_ms": 1e3 * median([s["draft_s"] for s in mine]),
                    "cost": step_s / plain_s, "speedup": tau * plain_s / step_s}
        # what the estimates predicted for these steps: each prompt's estimate of the shape, weighted by the
        # steps that prompt drafted with it (a prompt's shape can change mid-answer)
        weighted = [(sum(counted(s, key) for s in row.get("trace", ())), row["estimates"][key])
                    for row in rows if key in (row.get("estimates") or {})]
        total = sum(n for n, _ in weighted)
        if total:
            out[key]["estimated"] = {name: sum(n * est[name] for n, est in weighted) / total
                                     for name in ("tau", "cost", "speedup")}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
