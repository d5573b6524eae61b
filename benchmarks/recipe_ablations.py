#!/usr/bin/env python
"""The training recipe's choices, each measured on one fixed token budget (issue: drafters that pay).

Every arm trains a new EAGLE-3.1 drafter from scratch on the committed corpus with the same steps,
batch tokens, data order and seed, and differs from `base` in one flag:

    base             the release recipe from scratch: TTT 4, lr 3e-4 (3 % warmup, cosine), draft vocab 8k,
                     random head and layer, regenerated corpus
    init-head        --init-head target   (lm_head rows and final norm from the target's head)
    init-layer       --init-layer target  (the decoder layer starts as the target's last layer)
    init-both        both of the above: the drafter starts as the target's last layer and head
    vocab-16k        --draft-vocab-size 16384
    ttt-2, ttt-7     --ttt-steps 2 / 7
    lr-1e-4, lr-1e-3 --lr 1e-4 / 1e-3
    raw-sharegpt     --data sharegpt      (ShareGPT's own answers instead of the target's)
    layers-2         --draft-layers 2     (two decoder layers from scratch: issue 15's depth test)

Then tau on MT-bench first turns (float32, speculation forced on one tree, T=0 and T=1 seeded: a
property of the drafter, the scaling curve's measure). Everything is resumable: an arm whose
`final/` exists is not trained again, a half-trained arm continues with `--resume`, an evaluated arm
keeps its `eval.json`; run it again (in another session too) and it goes on where it stopped. Two
processes with disjoint `--arms` use two cores.

    python benchmarks/recipe_ablations.py --arms base,init-head,init-layer,vocab-16k &
    python benchmarks/recipe_ablations.py --arms ttt-2,ttt-7,lr-1e-4,lr-1e-3,raw-sharegpt &
    python benchmarks/recipe_ablations.py --report      # the table, once arms are done
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results" / "ablations"

BASE_ARGS = ["--variant", "eagle3.1", "--ttt-steps", "4", "--lr", "3e-4", "--warmup-ratio", "0.03",
             "--draft-vocab-size", "8192", "--max-len", "1024", "--batch-tokens", "2048", "--seed", "0"]
ARMS: dict[str, tuple[str, list[str]]] = {  # name -> (what differs, flags that replace the base's)
    "base": ("-", []),
    "init-head": ("--init-head target", ["--init-head", "target"]),
    "init-layer": ("--init-layer target", ["--init-layer", "target"]),
    "init-both": ("--init-head target --init-layer target", ["--init-head", "target", "--init-layer", "target"]),
    "vocab-16k": ("--draft-vocab-size 16384", ["--draft-vocab-size", "16384"]),
    "ttt-2": ("--ttt-steps 2", ["--ttt-steps", "2"]),
    "ttt-7": ("--ttt-steps 7", ["--ttt-steps", "7"]),
    "lr-1e-4": ("--lr 1e-4", ["--lr", "1e-4"]),
    "lr-1e-3": ("--lr 1e-3", ["--lr", "1e-3"]),
    "raw-sharegpt": ("--data sharegpt (ShareGPT's own answers)", ["--data", "sharegpt"]),
    "layers-2": ("--draft-layers 2", ["--draft-layers", "2"]),
}


def train_args(arm: str, args) -> list[str]:
    """The arm's `anchorspec train` flags: the base recipe with the arm's flags replacing the same ones."""
    flags = list(BASE_ARGS) + ["--data", args.data]
    extra = ARMS[arm][1]
    for i in range(0, len(extra), 2):
        if extra[i] in flags:
            flags[flags.index(extra[i]) + 1] = extra[i + 1]
        else:
            flags += extra[i:i + 2]
    return ["--target", args.target, *flags, "--max-steps", str(args.steps), "--dtype", args.train_dtype,
            "--threads", str(args.threads), "--eval-every", str(args.steps), "--save-every", "20",
            "--eval-prompts", "0", "--no-progress"]


def claim(run: Path) -> bool:
    """An arm is worked on by one process at a time: a lock file holding the owner's pid."""
    run.mkdir(parents=True, exist_ok=True)
    lock = run / "lock"
    if lock.exists():
        try:
            os.kill(int(lock.read_text()), 0)
            return False  # its owner is alive
        except (ValueError, ProcessLookupError, PermissionError):
            lock.unlink(missing_ok=True)  # a stale lock from a killed session
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def train(arm: str, run: Path, args) -> None:
    if (run / "final" / "config.json").is_file():
        return
    resume = ["--resume"] if (run / "run.json").is_file() else []
    cmd = [sys.executable, "-m", "anchorspec", "train", *train_args(arm, args), "--out", str(run), *resume]
    print(f"[{arm}] {' '.join(cmd[1:])}", flush=True)
    with open(run / "train.log", "a") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def evaluate(arm: str, run: Path, args) -> dict:
    """tau at T=0 and T=1 on the first `--limit` MT-bench turns, speculation forced on `--shape`."""
    out = run / "eval.json"
    if out.is_file():
        return json.loads(out.read_text())
    import torch

    from anchorspec.api import Engine
    from anchorspec.atomic import atomic_write
    from anchorspec.decode.tree import TreeShape
    from anchorspec.models.drafter import load_drafter
    from anchorspec.models.dtype import parse_dtype
    from anchorspec.models.target import load_target

    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.eval_dtype)
    target = load_target(args.target, dtype, pack="off")
    engine = Engine(target, load_drafter(run / "final", dtype), shape=TreeShape(*map(int, args.shape.split(","))),
                    fallback=False)
    prompts = [engine.encode(p["text"], chat=True) for p in load_prompts(args.prompts, args.limit)]
    result = {"prompts": len(prompts), "shape": args.shape, "dtype": args.eval_dtype, "max_new_tokens": args.new_tokens}
    for temperature in (0.0, 1.0):
        stats = None
        for i, ids in enumerate(prompts):
            res = engine.generate(ids, max_new_tokens=args.new_tokens, temperature=temperature, seed=i, speculative=True)
            stats = res.stats if stats is None else stats.merge(res.stats)
        key = "t0" if temperature == 0 else "t1"
        result[f"tau_{key}"] = stats.tau
        result[f"acceptance_{key}"] = stats.acceptance_per_depth
    atomic_write(out, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1) + "\n"))
    print(f"[{arm}] tau T=0 {result['tau_t0']:.3f}, T=1 {result['tau_t1']:.3f}", flush=True)
    return result


def arm_row(arm: str, run: Path) -> dict | None:
    if not (run / "eval.json").is_file():
        return None
    info = json.loads((run / "run.json").read_text())
    evals = [r["eval"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval" in r]
    summary = info.get("summary", {})
    return {"arm": arm, "differs": ARMS[arm][0], **json.loads((run / "eval.json").read_text()),
            "heldout_acc": evals[-1]["heldout_acc"] if evals else None,
            "vocab_coverage": info.get("draft_vocab", {}).get("coverage"),
            "steps": summary.get("steps"), "train_seconds": summary.get("train_seconds"),
            "train_tokens_per_s": summary.get("train_tokens_per_s"), "data": info.get("data", {})}


def report(root: Path, args) -> None:
    rows = [r for arm in ARMS if (r := arm_row(arm, root / arm))]
    if not rows:
        print(f"no evaluated arms under {root} yet")
        return
    base = next((r for r in rows if r["arm"] == "base"), None)
    batch = BASE_ARGS[BASE_ARGS.index("--batch-tokens") + 1]
    lines = [f"{args.steps} steps x {batch} tokens, TTT/lr/vocab as in the base unless the row changes it; "
             f"tau: MT-bench 1-{rows[0]['prompts']}, {rows[0]['dtype']}, tree {rows[0]['shape']} forced", "",
             "| arm | differs from base | held-out acc per TTT step | draft-vocab coverage | tau T=0 | vs base | "
             "tau T=1 | train tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{a:.3f}" for a in r["heldout_acc"]) if r["heldout_acc"] else "-"
        delta = f"{r['tau_t0'] - base['tau_t0']:+.3f}" if base and r is not base else "-"
        lines.append(f"| {r['arm']} | {r['differs']} | {acc} | {r['vocab_coverage']:.3f} | {r['tau_t0']:.3f} | {delta} | "
                     f"{r['tau_t1']:.3f} | {r['train_tokens_per_s']:.0f} |")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"steps{args.steps}"
    stem.with_suffix(".json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {stem}.json and .md")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=160, help="the fixed budget: optimizer steps of 2,048 tokens")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default="corpus/smollm2-135m-instruct", help="the regenerated corpus every arm but "
                   "raw-sharegpt trains on")
    p.add_argument("--train-dtype", default="bfloat16")
    p.add_argument("--eval-dtype", default="float32")
    p.add_argument("--shape", default="4,4,16")
    p.add_argument("--limit", type=int, default=10, help="MT-bench first turns for tau")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", default=DEFAULT_DATA)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", help="run directories (default: $ANCHORSPEC_HOME/runs/ablations-steps<N>)")
    p.add_argument("--report", action="store_true", help="only print and write the table of evaluated arms")
    args = p.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchorspec.models.hub import cache_home

    root = Path(args.root) if args.root else cache_home() / "runs" / f"ablations-steps{args.steps}"
    if not args.report:
        for arm in args.arms.split(","):
            run = root / arm
            if not claim(run):
                print(f"[{arm}] another process is on it; skipped", flush=True)
                continue
            try:
                train(arm, run, args)
                evaluate(arm, run, args)
            finally:
                (run / "lock").unlink(missing_ok=True)
    report(root, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
