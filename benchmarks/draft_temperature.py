"""Sampled speculation's acceptance against the temperature the drafter drafts at (no timing).

At T > 0 a chain step accepts a drafted token with probability sum_x min(p(x), q(x)) (spec §7), where p is
the target's distribution at T and q the drafter's. anchorspec drafts from softmax(drafter logits / T).
A drafter trained by cross-entropy against p can be flatter or sharper than p, and then drafting at
T * s for some s != 1 raises that overlap (any q keeps the output lossless: rejection sampling uses the q it
drew from). This measures the overlap along held-out answers, teacher-forced as in training (the TTT
unroll, `train/ttt.py`): for each depth k and factor s, the mean over scored positions of
sum_x min(p(x), q_s(x)), and the chain's expected tau 1 + a_1 + a_1 a_2 + ... from those means.

    python benchmarks/draft_temperature.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --data corpus/smollm2-135m-instruct --parts 30,31 --limit 24
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from anchorspec.api import attach_drafter
from anchorspec.data.corpus import CorpusExample, read_part
from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target
from anchorspec.train.ttt import ttt_forward


def examples_of_parts(folder: Path, parts: list[int], limit: int, max_len: int) -> list[CorpusExample]:
    """`limit` conversations spread over the given parts (not their first ones), cut to `max_len`."""
    out = []
    for part in parts:
        out += [CorpusExample(e.input_ids[:max_len], e.loss_mask[:max_len])
                for e in read_part(folder / f"part-{part:04d}.npz")]
    step = max(len(out) // limit, 1)
    return out[::step][:limit]


@torch.no_grad()
def overlaps(target, drafter, ex: CorpusExample, steps: int, temperature: float, factors: list[float]):
    """Per depth k and factor s: (sum of overlaps, positions scored) along one conversation."""
    ids = torch.tensor([ex.input_ids])
    loss = torch.tensor([ex.loss_mask])
    out = target.features(ids)
    logits = out.logits.float()
    res = ttt_forward(drafter, out.aux, ids, logits, loss, steps=steps, return_logits=True)
    d2t = drafter.draft_to_target
    T = ids.shape[1]
    sums = torch.zeros(steps, len(factors), dtype=torch.float64)
    counts = torch.zeros(steps, dtype=torch.long)
    for k in range(steps):
        n = T - k - 2
        if n <= 0:
            continue
        rows = torch.nonzero(loss[0, k + 2: k + 2 + n] > 0).flatten()  # assistant tokens predicted
        if rows.numel() == 0:
            continue
        p = torch.softmax(logits[0, k + 1 + rows] / temperature, dim=-1)[:, d2t].double()  # [R, Vd]
        lg = res.logits[k, 0, rows].double()
        for j, s in enumerate(factors):
            q = torch.softmax(lg / (temperature * s), dim=-1)
            sums[k, j] += torch.minimum(p, q).sum(-1).sum()
        counts[k] += rows.numel()
    return sums, counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, help="NAME=DIR, or DIR (repeatable)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="corpus/smollm2-135m-instruct")
    ap.add_argument("--parts", default="30,31", help="corpus parts to read (comma-separated numbers)")
    ap.add_argument("--limit", type=int, default=24, help="conversations")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="chain depth scored")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--factors", default="0.5,0.7,0.85,1.0,1.2,1.5")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="JSON file for the figures")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    factors = [float(x) for x in args.factors.split(",")]
    exs = examples_of_parts(Path(args.data), [int(x) for x in args.parts.split(",")], args.limit, args.max_len)
    report = {"config": vars(args), "drafters": {}}
    for spec in args.drafter:
        name, _, path = spec.rpartition("=")
        name = name or Path(path).name
        drafter = load_drafter(path, getattr(torch, args.dtype)).eval()
        aux = drafter.config.eagle_aux_hidden_state_layer_ids
        target = load_target(args.target, args.dtype, aux_layer_ids=aux, pack="off")
        attach_drafter(target, drafter)
        sums = torch.zeros(args.steps, len(factors), dtype=torch.float64)
        counts = torch.zeros(args.steps, dtype=torch.long)
        for ex in exs:
            s, c = overlaps(target, drafter, ex, args.steps, args.temperature, factors)
            sums += s
            counts += c
        alpha = sums / counts.clamp(min=1).unsqueeze(1)
        taus = [float(1 + sum(torch.cumprod(alpha[:, j], 0))) for j in range(len(factors))]
        report["drafters"][name] = {"positions": counts.tolist(), "factors": factors,
                                    "acceptance": alpha.tolist(), "expected_tau": taus}
        print(f"{name}: {len(exs)} conversations, T={args.temperature}, chain of {args.steps}, positions {counts.tolist()}")
        print("  s     " + "  ".join(f"a{k + 1:<5d}" for k in range(args.steps)) + "  expected tau")
        for j, s in enumerate(factors):
            print(f"  {s:<5.2f} " + "  ".join(f"{float(alpha[k, j]):.3f}" for k in range(args.steps)) + f"   {taus[j]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
