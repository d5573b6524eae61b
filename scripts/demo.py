#!/usr/bin/env python3
"""The demo: speculative against plain greedy decoding on a few prompts, and what came out of it.

Each prompt runs both ways in one process (the order alternates per prompt, after one warm-up of
each). Then the summary: the CPU, dtype and threads used; plain and speculative tokens/s side by side
with their ratio; tau; and whether every speculative output was token-identical to the plain one.
With --json, stdout carries one JSON object per prompt and a last one with "summary"; the readable
lines go to stderr. Progress bars appear on a terminal only (stderr), never in a log.

    python3 scripts/demo.py                                   # the prompts the project ships
    python3 scripts/demo.py --prompts ../shared/data/mt_bench/question.jsonl --limit 10 --json

Where the timed run's dtype is not float32 (bfloat16, the fast one on many CPUs), its outputs can part from
plain decoding's at a near-tie: a verify forward over several tokens rounds differently from one-token steps.
So the demo then checks losslessness where it is exact: the same prompts again in float32 (eager steps,
speculation forced at the timed run's shape), where every speculative output must equal plain decoding's;
a difference there is a bug, and the demo exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import anchorspec
from anchorspec import load
from anchorspec.data.readers import read_prompts
from anchorspec.errors import AnchorspecError
from anchorspec.models.dtype import DTYPE_CHOICES, bf16_hardware, cpu_description

SHIPPED_PROMPTS = Path(anchorspec.__file__).parent / "data" / "demo_prompts.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="model directory, hub id or alias")
    p.add_argument("--drafter", default="checkpoints/smollm2-135m-instruct-eagle3.1", help="drafter directory")
    p.add_argument("--prompts", default=str(SHIPPED_PROMPTS),
                   help="JSONL: 'prompt' or MT-bench 'turns' (first turn); default: the prompts the project ships")
    p.add_argument("--limit", type=int, default=5, help="first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt, at most")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="compute dtype (auto: the fast one here)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--compile", default="on", choices=["auto", "on", "off"],
                   help="the target's steps through its compiled graph: on compiles it first where this machine "
                        "has none yet (on a CPU once, about a minute and a half, kept for later runs); auto uses it "
                        "only if it is on disk; off runs eager steps")
    p.add_argument("--float32-check", default="auto", choices=["auto", "on", "off"],
                   help="after the timed run, the same prompts in float32 (eager, speculation forced), whose outputs "
                        "must equal plain decoding's; auto: when the timed run's dtype is not float32")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout: one per prompt, then the summary")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or (args.threads is not None and args.threads < 1):
        p.error("--limit, --max-new-tokens and --threads must be >= 1")
    return args


def tau_of(accepted: int, steps: int) -> float | None:
    """Tokens per verification: accepted draft tokens per verification + 1 (None when nothing was verified)."""
    return (accepted + steps) / steps if steps else None


def float32_check(args, prompts, shape, generate) -> dict:
    """The lossless check: plain and speculative greedy decoding in float32, every step speculating at
    `shape` (fallback off, so drafts are verified even where they would not pay)."""
    engine = load(args.target, args.drafter, "float32", threads=args.threads, compile=False, fallback=False,
                  remember=False)
    identical = steps = accepted = 0
    for prompt in tqdm(prompts, desc="float32 check", unit="prompt", file=sys.stderr, disable=not sys.stderr.isatty()):
        plain = engine.generate(prompt, **generate, speculative=False)
        spec = engine.generate(prompt, **generate, shape=shape)
        identical += spec.token_ids == plain.token_ids
        steps += spec.stats.verify_steps
        accepted += spec.stats.accepted_tokens
    tau = tau_of(accepted, steps)
    return {"identical_to_plain": identical, "prompts": len(prompts), "verify_steps": steps,
            "tau": None if tau is None else round(tau, 3)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 135M model loads in a second; its bar would only clutter a log
    say = (lambda text: print(text, file=sys.stderr)) if args.json else print  # readable lines
    prompts = read_prompts(args.prompts)[: args.limit]
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads,
                  compile={"on": True, "off": False}.get(args.compile, "auto"))
    generate = dict(chat=True, max_new_tokens=args.max_new_tokens, temperature=0.0)
    for speculative in (False, True):  # warm-up: first-call costs, and the engine measures its step costs
        engine.generate("Hello", **{**generate, "max_new_tokens": 8}, speculative=speculative)
    shape = engine.shape

    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}  # new tokens, seconds
    steps = accepted = identical = 0
    bar = tqdm(prompts, desc="demo", unit="prompt", file=sys.stderr, disable=not sys.stderr.isatty())
    for i, prompt in enumerate(bar):
        runs = {}
        for speculative in ((False, True) if i % 2 == 0 else (True, False)):
            runs[speculative] = engine.generate(prompt, **generate, speculative=speculative)
        plain, spec = runs[False], runs[True]
        same = spec.token_ids == plain.token_ids
        identical += same
        steps += spec.stats.verify_steps
        accepted += spec.stats.accepted_tokens
        for name, res in (("plain", plain), ("speculative", spec)):
            totals[name][0] += res.stats.new_tokens
            totals[name][1] += res.stats.total_s
        if args.json:
            bar.write(json.dumps({"prompt": prompt, "text": spec.text, "identical_to_plain": same,
                                  "speculative": spec.stats.to_dict(), "plain": plain.stats.to_dict()},
                                 ensure_ascii=False), file=sys.stdout)
        else:
            bar.write(f"\n## {prompt}\n{spec.text}", file=sys.stdout)
            tau = f"tau {spec.stats.tau:.2f}" if spec.stats.verify_steps else "no draft verified"
            bar.write(f"[speculative {spec.stats.tokens_per_s:.1f} tok/s, {tau}; plain "
                      f"{plain.stats.tokens_per_s:.1f} tok/s; identical to plain: {'yes' if same else 'NO'}]",
                      file=sys.stdout)

    rate = {name: n / s if s > 0 else 0.0 for name, (n, s) in totals.items()}
    ratio = rate["speculative"] / rate["plain"] if rate["plain"] else 0.0
    tau = tau_of(accepted, steps)
    cpu = cpu_description()
    native = bf16_hardware(cpu["flags"])
    dtype = str(engine.target.dtype).removeprefix("torch.")
    steps_kind = ("compiled ahead of time" if engine.target.aot else "torch.compile" if engine.target.compiled
                  else "eager")
    summary = {"target": args.target, "drafter": args.drafter, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "cpu": cpu["model"], "bf16_cpu_flags": native,
               "dtype": dtype, "dtype_asked": args.dtype, "threads": torch.get_num_threads(), "steps": steps_kind,
               "draft_shape": f"{shape.top_k},{shape.depth},{shape.total_tokens}", "shape_source": engine.shape_source,
               "plain_tokens_per_s": round(rate["plain"], 2), "speculative_tokens_per_s": round(rate["speculative"], 2),
               "speedup": round(ratio, 3), "tau": None if tau is None else round(tau, 3), "verify_steps": steps,
               "identical_to_plain": identical}
    check = None
    if args.float32_check == "on" or (args.float32_check == "auto" and dtype != "float32"):
        check = summary["float32_check"] = float32_check(args, prompts, shape, generate)
    if args.json:
        print(json.dumps({"summary": summary}))
    say("")
    say(f"== result: {args.target}, {len(prompts)} prompts from {args.prompts}, up to {args.max_new_tokens} new "
        "tokens each, chat template, greedy")
    threads = torch.get_num_threads()
    chosen = " (chosen by --dtype auto)" if args.dtype == "auto" else ""
    say(f"machine: {cpu['model']} ({', '.join(native) if native else 'no native bf16'}), "
        f"{threads} thread{'s' if threads != 1 else ''}; dtype {dtype}{chosen}; target steps {steps_kind}")
    say(f"drafter: {args.drafter}, draft shape {summary['draft_shape']} ({engine.shape_source})")
    say(f"  plain        {rate['plain']:7.1f} tok/s")
    say(f"  speculative  {rate['speculative']:7.1f} tok/s   {ratio:.2f}x plain")
    say(f"tau {tau:.2f} over {steps} verifications (accepted draft tokens per verification + 1)" if tau else
        "tau: none (no draft was verified: speculation did not pay here, so every step ran plain)")
    verdict = f"outputs identical to plain: {identical} of {len(prompts)}"
    if identical < len(prompts) and dtype == "bfloat16":
        verdict += (" (bfloat16: a verify forward over several tokens rounds differently from one-token steps, so a "
                    "near-tie can flip; " + ("the float32 check below is the exact one)" if check is not None else
                                             "--dtype float32 gives identical outputs)"))
    say(verdict)
    if check is not None:
        tau = f"tau {check['tau']:.2f}" if check["tau"] else "no draft verified"
        say(f"float32 check (eager, every step speculating at {summary['draft_shape']}): outputs identical to plain: "
            f"{check['identical_to_plain']} of {check['prompts']} ({tau})")
        if check["identical_to_plain"] < check["prompts"]:
            say("demo: LOSSLESSNESS FAILURE: in float32 a speculative output differs from plain decoding's")
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AnchorspecError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
