#!/usr/bin/env python
"""Does a drafter accept at inference what training-time test says it predicts? One held-out answer
at a time, the same text scored two ways, in float32:

- replay: `decode.shape.replay` walks the answer with greedy chains of --depth drafted by the
  inference proposer (the engine's own path), and records the accepted length at each root;
- TTT: `ttt_forward` over the same sequence gives, for every slot t and step k, whether the
  drafter's argmax equals the answer's token x_{t+k+2}. The chain drafted at root `pos` is TTT's
  slot pos-1, so its accepted length is the number of leading correct steps there.

At the roots replay visits, the two must agree exactly (a gap is a train/inference mismatch). The
script also prints the trainer's own held-out accuracy (only tokens whose target argmax is in
the draft vocabulary count), and what the trainer's `sim_tau` assumes: TTT's accuracy per step over *every*
slot, unconditionally, next to the conditional acceptance per depth at the roots, which is what
`generate` measures. The difference between those explains a held-out `sim_tau` above a real tau.

    python benchmarks/ttt_vs_replay.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 --limit 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from anchorspec.api import attach_drafter
from anchorspec.data.corpus import read_corpus
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import replay
from anchorspec.decode.tree import TreeShape
from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target
from anchorspec.data.chat import first_answer
from anchorspec.train.dataset import split_heldout
from anchorspec.train.trainer import simulated_tau
from anchorspec.train.ttt import ttt_forward


def chain_lengths(correct: torch.Tensor) -> torch.Tensor:
    """[K, T] bool -> [T]: leading correct steps per slot."""
    return torch.cumprod(correct.long(), dim=0).sum(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--corpus", default="corpus/smollm2-135m-instruct")
    p.add_argument("--limit", type=int, default=20, help="held-out answers to score")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heldout", type=float, default=0.02, help="train's --heldout (the same examples)")
    p.add_argument("--seed", type=int, default=0, help="train's --seed (the same examples)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON of the figures")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_target(args.target, torch.float32, pack="off")
    drafter = load_drafter(args.drafter, torch.float32).eval()
    attach_drafter(target, drafter)
    proposer = EagleProposer(drafter)
    shape = TreeShape(top_k=1, depth=args.depth, total_tokens=args.depth + 1)  # a chain
    K = args.depth

    examples = read_corpus(args.corpus, vocab_size=target.vocab_size)
    _, held = split_heldout([e.input_ids for e in examples], args.heldout, args.seed, minimum=2)
    trainer_hits = torch.zeros(K, dtype=torch.float64)  # the trainer's own accuracy (its validity rules)
    trainer_n = torch.zeros(K, dtype=torch.float64)
    uncond_hits = torch.zeros(K, dtype=torch.float64)
    uncond_n = torch.zeros(K, dtype=torch.float64)
    root_hist_replay, root_hist_ttt = torch.zeros(K + 1), torch.zeros(K + 1)
    mismatched_roots = roots = scored = 0
    for i in held:
        if scored >= args.limit:
            break
        got = first_answer(examples[i].input_ids, examples[i].loss_mask)
        if got is None or len(got[0]) - got[1] < K + 3:
            continue
        seq_list, start = got
        seq = torch.tensor(seq_list)
        # replay: the engine's proposer, chain of K, greedy, against the answer's own tokens
        visited = []
        with torch.inference_mode():
            replay(target, proposer, seq, start, shape, roots=visited)
        # TTT over the same sequence: correct[k, t] = argmax at (t, k) == x_{t+k+2}
        with torch.no_grad():
            feats = target.features(seq[None])
            logits_d = feats.logits[..., drafter.draft_to_target]
            in_draft = drafter.t2d[feats.logits.argmax(-1)]
            mask = torch.zeros(1, len(seq_list), dtype=torch.long)
            mask[0, start:] = 1
            out = ttt_forward(drafter, feats.aux, seq[None], logits_d, mask, steps=K, return_logits=True,
                              target_in_draft=in_draft)
        trainer_hits += out.acc_per_step.double() * out.valid_per_step.double()
        trainer_n += out.valid_per_step.double()
        pred = drafter.draft_to_target[out.logits[:, 0].argmax(-1)]  # [K, T] target ids
        T = len(seq_list)
        correct = torch.zeros(K, T, dtype=torch.bool)
        valid = torch.zeros(K, T, dtype=torch.bool)
        for k in range(K):
            for t in range(T):
                if t >= start - 1 and t + k + 2 < T:  # slot t is a chain root's (root pos = t + 1)
                    valid[k, t] = True
                    correct[k, t] = bool(pred[k, t] == seq[t + k + 2])
        uncond_hits += (correct & valid).sum(1).double()
        uncond_n += valid.sum(1).double()
        lengths = chain_lengths(correct)
        for pos, accepted, tree in visited:
            t = pos - 1
            want = min(int(lengths[t]), tree.depth)
            root_hist_replay[accepted] += 1
            root_hist_ttt[want] += 1
            roots += 1
            mismatched_roots += int(want != accepted)
        scored += 1

    def conditional(hist: torch.Tensor) -> list[float]:
        reach = [float(hist[d:].sum()) for d in range(K + 1)]
        return [reach[d + 1] / reach[d] if reach[d] else float("nan") for d in range(K)]

    uncond = (uncond_hits / uncond_n.clamp(min=1)).tolist()
    report = {
        "drafter": args.drafter, "answers": scored, "roots": roots, "depth": K,
        "roots_where_ttt_and_replay_disagree": mismatched_roots,
        "replay_tau": 1 + float((root_hist_replay * torch.arange(K + 1)).sum()) / max(roots, 1),
        "ttt_tau_at_the_same_roots": 1 + float((root_hist_ttt * torch.arange(K + 1)).sum()) / max(roots, 1),
        "replay_acceptance_per_depth": conditional(root_hist_replay),
        "ttt_unconditional_acc_per_step_all_slots": uncond,
        "sim_tau_from_those": simulated_tau(uncond),
        "trainer_heldout_acc_per_step": (trainer_hits / trainer_n.clamp(min=1)).tolist(),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
