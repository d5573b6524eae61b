#!/usr/bin/env python
"""Trained drafters against plain Hugging Face greedy `generate`, batch 1, in one process.

For each MT-bench first turn (chat template applied), the methods run back to back in an order
that rotates per prompt: HF `generate` greedy (the baseline), optionally the project's plain loop
(`--plain`), then each drafter with speculative decoding at temperature 0. Per method: tau (tokens
per verification), acceptance per depth, median tokens/s, the per-prompt speedup over HF (median
and mean), and how many outputs differ from HF's tokens. With --temperature1, each drafter also
runs sampled (T = 1, seeded) and reports tau. With --compile, the project's greedy methods also run
on a compiled copy of the target with compiled twins of the drafters (`generate --compile`), timed
after a warm-up that compiles their step shapes; --eager-drafter adds each drafter eager on the
compiled target.

Two protocols:
- `--shape 4,4,16` (the default): speculation forced on, one fixed tree: tau is a property of the
  drafter (the scaling curve's measure: `--dtype float32 --limit 10`);
- `--shape default`: what `anchorspec generate --drafter DIR` does with no options: the tuned shape
  if `anchorspec tune` ran, else the chain the measured costs favour, and the fallback to plain steps
  where speculation does not pay (each drafter keeps its own engine, so its costs and acceptance
  accumulate over the prompts as they do in one process). Each drafter's per-prompt rows also say
  what the shape was chosen on (`expected`: each candidate's expected tau, step cost over a plain
  step and speedup, StreamMonitor.estimates) and which shapes exploring drafted instead (`explored`).

    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/bench_drafters.py \
        --drafter eagle3=checkpoints/smollm2-135m-instruct-eagle3 \
        --drafter eagle3.1=checkpoints/smollm2-135m-instruct-eagle3.1 --limit 20 --out out/bench_drafters.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, environment, hf_generate, load_prompts, median, named_drafters, timed, warn_if_busy  # noqa: E402

from anchorspec.api import Engine  # noqa: E402
from anchorspec.bench.runner import frozen_heap  # noqa: E402
from anchorspec.decode.sampling import SamplingParams  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.metrics import GenerationStats  # noqa: E402
from anchorspec.models.compiled import graphs_compiled  # noqa: E402
from anchorspec.models.drafter import load_drafter  # noqa: E402
from anchorspec.models.packed import is_packed  # noqa: E402
from anchorspec.models.target import load_target, parse_dtype, stock_twin  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--every", type=int, default=1, metavar="N",
                   help="every N-th prompt of the file (MT-bench: 5 takes 2 of each of its 8 categories; its first "
                        "10 are all writing)")
    p.add_argument("--offset", type=int, default=0, metavar="I",
                   help="start from the I-th prompt (with --every 2: 1 takes the other half)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", default="4,4,16",
                   help="TOP_K,DEPTH,TOTAL: that tree, speculation forced on; `default`: generate's defaults (above)")
    p.add_argument("--pack", default=None, choices=["auto", "on", "off"],
                   help="prepack the target's weights for oneDNN (default: $ANCHORSPEC_PACK or auto)")
    p.add_argument("--plain", action="store_true", help="also run the project's plain loop (generate --no-spec)")
    p.add_argument("--compile", action="store_true",
                   help="also run the project's methods (greedy) on a compiled target (Target.compile), after a "
                        "warm-up that compiles their step shapes; graphs compiled while timed are reported; "
                        "each drafter is compiled too (Eagle3Drafter.compile)")
    p.add_argument("--eager-drafter", action="store_true",
                   help="with --compile: also run each drafter eager on the compiled target (what compiling the "
                        "drafter adds)")
    p.add_argument("--temperature1", action="store_true", help="also run each drafter sampled at T=1 (tau only)")
    p.add_argument("--option", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also run each drafter with these Engine.generate arguments, e.g. staged1:staged=1, "
                        "drift:prune=drift, pid:depth_control=pid (values that look like integers are integers)")
    p.add_argument("--monitor", action="append", default=[], metavar="NAME:ATTR=VALUE[,ATTR=VALUE]",
                   help="set StreamMonitor attributes on drafter NAME's engine (a shape-choice rule under test), "
                        "e.g. --drafter a=DIR --drafter b=DIR --monitor b:follow_pace=0")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def parse_option(text: str) -> tuple[str, dict]:
    name, _, pairs = text.partition(":")
    kwargs = {}
    for pair in filter(None, pairs.split(",")):
        key, _, value = pair.partition("=")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    if not name or not kwargs:
        raise SystemExit(f"{text!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    return name, kwargs


class Method:
    """kind: "hf" (HF generate), "plain" (the project's loop), "spec" (the engine's drafter)."""

    def __init__(self, name, engine: Engine, kind: str, temperature=0.0, options=None):
        self.name, self.engine, self.kind, self.temperature = name, engine, kind, temperature
        self.options = options or {}  # extra Engine.generate arguments (a decoding option under test)
        self.rows = []
        self.stats: GenerationStats | None = None

    def run(self, ids, max_new, seed):
        """(tokens, seconds, stats or None, the draft shape as "K,D,N" or None, what the shape was chosen
        on: {} unless spec)."""
        if self.kind == "hf":
            tokens, dt = timed(hf_generate, self.engine, ids, max_new)
            return tokens, dt, None, None, {}
        shape, monitor, decision = None, self.engine.monitor, {}
        if self.kind == "spec":  # what generate will draft with (shape_for is what it asks; asking twice is the same)
            s = self.engine.shape_for(SamplingParams(self.temperature))
            shape = f"{s.top_k},{s.depth},{s.total_tokens}"
            # what the shape was chosen on, and (below) the candidates explored instead during the prompt
            decision["expected"] = {k: {part: None if v is None else round(v, 4) for part, v in parts.items()}
                                    for k, parts in monitor.estimates().items()}
            explored = monitor.explored_shapes.copy()
        res, dt = timed(self.engine.generate, ids, max_new_tokens=max_new, temperature=self.temperature,
                        seed=seed, speculative=self.kind == "spec", **self.options)
        if self.kind == "spec":
            decision["explored"] = dict(monitor.explored_shapes - explored)
            decision["pace"] = round(monitor.pace(), 4)  # how slow the host ran against the costs' unit
        return res.token_ids, dt, res.stats if self.kind == "spec" else None, shape, decision


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype, pack=args.pack)
    engine = Engine(target)
    stock = Engine(stock_twin(target, args.target, dtype))
    prompts = load_prompts(args.data, args.limit, args.every, args.offset)
    encoded = [engine.encode(p["text"], chat=True) for p in prompts]
    defaults = args.shape == "default"
    tree = None if defaults else TreeShape(*(int(x) for x in args.shape.split(",")))
    options = [parse_option(text) for text in args.option]  # bad text fails before any drafter loads
    rules = dict(parse_option(text) for text in args.monitor)
    unknown = set(rules) - {name for name, _ in named_drafters(args.drafter)}
    if unknown:
        raise SystemExit(f"--monitor names no --drafter: {', '.join(sorted(unknown))}")
    methods = [Method("hf_generate", stock, "hf")] + ([Method("anchorspec_plain", engine, "plain")] if args.plain else [])
    aux_layers = None
    for name, path in named_drafters(args.drafter):
        d = load_drafter(path, dtype)
        aux_layers = aux_layers or tuple(d.config.eagle_aux_hidden_state_layer_ids)
        if aux_layers != tuple(d.config.eagle_aux_hidden_state_layer_ids):  # one target serves them all
            raise SystemExit(f"{name}: aux layers differ from the other drafters'; benchmark them separately")
        # its own engine: the drafter's measured shape, costs and fallback state stay its own
        for temperature in (0.0, 1.0) if args.temperature1 else (0.0,):
            suffix = "@T=1" if temperature else ""
            for label, kwargs in [(name, {})] + [(f"{name}+{o}", kw) for o, kw in options]:
                spec = Engine(target, d, shape=tree, fallback=defaults)
                for attr, value in rules.get(name, {}).items():
                    if not hasattr(spec.monitor, attr):
                        raise SystemExit(f"--monitor {name}:{attr}: StreamMonitor has no attribute {attr!r}")
                    setattr(spec.monitor, attr, value)
                methods.append(Method(label + suffix, spec, "spec", temperature, kwargs))
    compiled = None
    if args.compile:  # twins of the greedy project methods on a compiled copy of the target
        compiled = load_target(args.target, dtype, pack="off")
        compiled.compile()
        drafters = {}  # id(drafter) -> a compiled twin sharing its weights (the eager methods keep theirs)
        for m in methods:
            if m.kind == "spec" and id(m.engine.drafter) not in drafters:
                drafters[id(m.engine.drafter)] = twin = copy.copy(m.engine.drafter)
                twin.compile()
        greedy = [m for m in methods if m.kind != "hf" and not m.temperature]
        twins = [Method(f"{m.name}+compiled", Engine(compiled, drafters[id(m.engine.drafter)], shape=tree,
                                                     fallback=defaults)
                        if m.kind == "spec" else Engine(compiled), m.kind, 0.0, m.options) for m in greedy]
        if args.eager_drafter:  # the compiled target with the eager drafter: what compiling the drafter adds
            twins += [Method(f"{m.name}+compiled_eager_drafter", Engine(compiled, m.engine.drafter, shape=tree,
                                                                        fallback=defaults), m.kind, 0.0, m.options)
                      for m in greedy if m.kind == "spec"]
        methods += twins
    for m in methods:  # warm-up
        m.run(encoded[0], 16, 0)
    if compiled is not None:  # a full-length generation per compiled method: its verify and plain shapes
        for m in methods:
            if "+compiled" in m.name:
                m.run(encoded[-1], args.max_new_tokens, 0)
        warm_graphs = graphs_compiled()
        print(f"compiled: {warm_graphs} graphs in the warm-up (target {compiled.compiles}, drafters "
              f"{sum(d.compiles for d in drafters.values())})")
    bar = tqdm(list(enumerate(zip(prompts, encoded))), desc="bench", unit="prompt", dynamic_ncols=True)
    with frozen_heap():  # each gc.collect() below walks only what the runs made
        for i, (prompt, ids) in bar:
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            out = {}
            for m in order:
                gc.collect()
                out[m.name] = m.run(ids, args.max_new_tokens, seed=i)
            base_tokens, base_dt, *_ = out["hf_generate"]
            for m in methods:
                tokens, dt, stats, shape, decision = out[m.name]
                m.rows.append({"id": prompt["id"], "new_tokens": len(tokens), "seconds": dt, "shape": shape,
                               "tokens_per_s": len(tokens) / dt,
                               "speedup": (len(tokens) / dt) / (len(base_tokens) / base_dt),
                               "identical_to_hf": tokens == base_tokens, "stats": stats.to_dict() if stats else None,
                               **decision})
                if stats is not None:
                    m.stats = stats if m.stats is None else m.stats.merge(stats)
    results = {"environment": environment(argparse.Namespace(threads=args.threads)), "dtype": args.dtype,
               "packed": is_packed(target.model), "prompts": len(prompts), "prompt_ids": [p["id"] for p in prompts],
               "max_new_tokens": args.max_new_tokens, "shape": args.shape, "fallback": defaults, "methods": {}}
    if compiled is not None:
        results["compiled_graphs"] = {"warm_up": warm_graphs, "timed": graphs_compiled() - warm_graphs}
        print(f"compiled: {graphs_compiled() - warm_graphs} more graphs while timed")
    for m in methods:
        if m.kind == "spec" and defaults:
            results.setdefault("shapes", {})[m.name] = {
                "shape": [m.engine.shape.top_k, m.engine.shape.depth, m.engine.shape.total_tokens],
                "source": m.engine.shape_source}
    for name, shape in results.get("shapes", {}).items():
        print(f"{name}: draft shape {','.join(map(str, shape['shape']))} ({shape['source']})")
    print(f"\n| method | tau | acceptance per depth | median tok/s | speedup vs HF (median / mean) | differs from HF |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        s = {"median_tokens_per_s": median([r["tokens_per_s"] for r in m.rows]),
             "median_speedup": median([r["speedup"] for r in m.rows]),
             "mean_speedup": statistics.fmean(r["speedup"] for r in m.rows),
             "differs_from_hf": sum(not r["identical_to_hf"] for r in m.rows),
             "tau": m.stats.tau if m.stats and m.stats.verify_steps else None,  # None: the fallback never drafted
             "verify_steps": m.stats.verify_steps if m.stats else 0,
             "acceptance_per_depth": m.stats.acceptance_per_depth if m.stats else None,
             "fallback_switches": sum((r["stats"] or {}).get("fallback_switches") or 0 for r in m.rows),
             "explored_steps": sum((r["stats"] or {}).get("explored_steps") or 0 for r in m.rows),
             "prompts_per_shape": dict(Counter(r["shape"] for r in m.rows if r["shape"])),
             "per_prompt": m.rows}
        results["methods"][m.name] = s
        acc = ", ".join(f"{a:.2f}" for a in s["acceptance_per_depth"]) if m.stats else "-"
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        print(f"| {m.name} | {tau} | {acc} | {s['median_tokens_per_s']:.1f} | "
              f"{s['median_speedup']:.2f}x / {s['mean_speedup']:.2f}x | {s['differs_from_hf']}/{len(m.rows)} |")
    for name, s in results["methods"].items():
        if s["prompts_per_shape"]:
            print(f"{name}: prompts per draft shape {s['prompts_per_shape']}, {s['explored_steps']} explored steps, "
                  f"{s['fallback_switches']} fallback switches")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
