#!/usr/bin/env python
"""Is the data what limits a drafter? Its TTT accuracy per step on conversations it trained on against
conversations it never saw, through one scorer (`Trainer.fit_gap`, what `train` now reports at its end):

- training conversations well above held-out ones: the drafter has memorised its corpus; more (new)
  data is what the next round needs;
- level, or below: the corpus is not memorised; the steps' noise (learning rate against batch size) or
  the drafter's capacity limits it, and more passes of a quieter schedule can still gain.

The held-out split is `train`'s own (seeded by --seed over the same data and --max-len), so pass the
options the drafter was trained with. Each drafter is scored on the same conversations, in one process.

    python benchmarks/fit_gap.py --drafter release=checkpoints/smollm2-135m-instruct-eagle3 \\
        --data corpus/smollm2-135m-instruct --out benchmarks/results/s59/fit-gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import environment  # noqa: E402

from anchorspec.atomic import atomic_write_text  # noqa: E402
from anchorspec.train.trainer import TrainConfig, Trainer  # noqa: E402


def named(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    return (name, path) if sep else (Path(spec).name, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR", help="repeatable")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", nargs="+", default=["corpus/smollm2-135m-instruct"])
    ap.add_argument("--conversations", type=int, default=128, help="scored on each side, spread over the split")
    ap.add_argument("--heldout", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0, help="train's --seed (the split)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="the autocast training used")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", help="JSON")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows = {}
    for name, path in (named(s) for s in args.drafter):
        # a trainer per drafter: its vocabulary mapping (d2t) is part of what the objective scores with; variant and
        # draft vocabulary size None: the trainer takes the drafter's own
        cfg = TrainConfig(target=args.target, data=args.data, out="/tmp/anchorspec-fit-gap-unused", init_from=path,
                          variant=None, draft_vocab_size=None, ttt_steps=args.ttt_steps, max_len=args.max_len,
                          batch_tokens=args.batch_tokens, dtype=args.dtype, seed=args.seed, heldout=args.heldout,
                          eval_heldout=args.conversations, eval_prompts=0, eval_replay=0, max_steps=1, progress=False)
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        fit = trainer.fit_gap()
        rows[name] = {"path": path, **fit, "seconds": time.perf_counter() - t0}
        print(f"{name}: train acc {', '.join(f'{a:.3f}' for a in fit['train_acc'])} | held-out "
              f"{', '.join(f'{a:.3f}' for a in fit['heldout_acc'])} | gap {', '.join(f'{g:+.3f}' for g in fit['gap'])} "
              f"({fit['scored']} each, {rows[name]['seconds']:.0f} s)", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"environment": environment(args), "drafters": rows}
        atomic_write_text(args.out, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
