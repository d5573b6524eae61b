#!/usr/bin/env python
"""The depth controllers at work on one answer whose acceptance changes: prose, then code (issue 15).

One greedy generation per controller, speculation forced on at every step (no fallback), the same
prompt, drafter and chain: `--depth-control pid`, the step rule (`--depth-control step`) and the
fixed chain. Per verify step it records the drafted depth, the tokens accepted and where in the
answer the step was; the plot shows depth over the answer's tokens with the accepted share, and a
line where the answer's first code block starts. Outputs must be identical (greedy is lossless
whatever the depth), and the script says so.

    python benchmarks/pid_trace.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from anchorspec.api import load  # noqa: E402
from anchorspec.atomic import atomic_write_text  # noqa: E402
from anchorspec.decode.adaptive import DEPTH_CONTROLS  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, generate_speculative  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

PROMPT = ("Explain in two short paragraphs what binary search is and why it is fast. "
          "Then write a Python function that implements it, with comments.")


def recording(controller):
    """Wrap `observe` so every verify step is logged as (drafted depth, accepted)."""
    steps = []
    observe = controller.observe

    def logged(drafted_depth: int, accepted: int) -> None:
        steps.append((drafted_depth, accepted))
        observe(drafted_depth, accepted)

    controller.observe = logged
    return steps


def run(engine, ids, control: str | None, base: TreeShape, max_new: int) -> dict:
    cfg = GenerationConfig(max_new_tokens=max_new, stop_token_ids=engine.stop_token_ids())
    if control is None:  # the fixed chain: no controller, so no per-step log (tau from the stats)
        res = generate_speculative(engine.target, engine.proposer, ids, cfg, base)
        return {"tokens": res.token_ids, "steps": None, "tau": res.stats.tau}
    controller = DEPTH_CONTROLS[control](base, min_depth=1, max_depth=base.depth + 3)
    steps = recording(controller)
    res = generate_speculative(engine.target, engine.proposer, ids, cfg, controller)
    return {"tokens": res.token_ids, "steps": steps, "tau": res.stats.tau}


def code_start(tokenizer, tokens: list[int]) -> int | None:
    """Index of the first answer token whose decoded prefix contains a code fence."""
    for k in range(1, len(tokens) + 1):
        if "```" in tokenizer.decode(tokens[:k]):
            return k - 1
    return None


def plot(results: dict, fence: int | None, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for name, r in results.items():
        if not r["steps"]:
            continue
        pos, x, share, window = 0, [], [], []
        depth = []
        for d, a in r["steps"]:
            x.append(pos)
            depth.append(d)
            window = (window + [a / d])[-8:]
            share.append(sum(window) / len(window))
            pos += a + 1
        top.step(x, depth, where="post", label=name)
        bottom.plot(x, share, label=name)
    for ax in (top, bottom):
        if fence is not None:
            ax.axvline(fence, color="grey", linestyle="--", linewidth=1)
    if fence is not None:
        top.text(fence, top.get_ylim()[1], " code starts", va="top", fontsize=8, color="grey")
    top.set_ylabel("drafted depth")
    bottom.set_ylabel("accepted share\n(last 8 drafts)")
    bottom.set_xlabel("answer token")
    top.legend(fontsize=8)
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--chain", type=int, default=3, help="the starting (and the fixed) chain depth")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pid"))
    args = p.parse_args(argv)
    if args.chain < 1 or args.max_new_tokens < 1:
        p.error("--chain and --max-new-tokens must be >= 1")
    engine = load(args.target, args.drafter, dtype=args.dtype, threads=args.threads, fallback=False, pack="off",
                  remember=False)
    ids = engine.encode(args.prompt, chat=True, system=None)
    base = TreeShape.chain(args.chain)
    results = {name: run(engine, ids, control, base, args.max_new_tokens)
               for name, control in (("pid", "pid"), ("step rule", "step"), (f"fixed chain {args.chain}", None))}
    reference = results["pid"]["tokens"]
    identical = {name: r["tokens"] == reference for name, r in results.items()}
    fence = code_start(engine.tokenizer, reference)
    out = Path(args.out)
    summary = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype, "threads": args.threads,
               "chain": args.chain, "prompt": args.prompt, "answer": engine.tokenizer.decode(reference),
               "code_starts_at_token": fence, "identical_outputs": identical,
               "controllers": {name: {"tau": r["tau"], "steps": r["steps"]} for name, r in results.items()}}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "pid_trace.json", json.dumps(summary, indent=1) + "\n")
    title = (f"{Path(args.drafter).name}, {args.dtype}, chain {args.chain} start, greedy; "
             + ", ".join(f"{n}: tau {r['tau']:.2f}" for n, r in results.items()))
    plot(results, fence, out / "pid_trace.png", title)
    for name, r in results.items():
        depths = [d for d, _ in r["steps"]] if r["steps"] else []
        extra = f", depths {min(depths)}-{max(depths)}" if depths else ""
        print(f"{name}: tau {r['tau']:.2f}{extra}, identical to pid: {identical[name]}")
    print(f"code starts at answer token {fence}; wrote {out / 'pid_trace.png'} and {out / 'pid_trace.json'}")
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
