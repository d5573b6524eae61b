#!/usr/bin/env python
"""Would a draft vocabulary that grows with the context lift MT-bench's weakest categories? (an experiment)

On MT-bench writing, stem and humanities 8-12 % of the target's answer tokens lie outside the 8k draft
vocabulary and can never be drafted, and many of them are words of the prompt (" orbital", " GDP").
Here the release's head gets extra rows for such tokens: the target's output-embedding row of each,
mapped into the drafter's head space by one linear map fitted (least squares) on the 8k rows the two
heads share. The default 4,4,16 tree is replayed (`decode.shape.replay`, greedy, no verify forwards)
along the target's own greedy answers, three ways:

- base: the drafter as released;
- prompt: plus the prompt's tokens outside its vocabulary (known before decoding: a real option);
- oracle: plus every outside token of the prompt and the whole answer (not realisable: it knows the
  answer's words in advance; the ceiling for a vocabulary that grows as the answer is written).

Nothing here is trained for the extra rows. One process, one dtype.

    python benchmarks/context_vocab.py --out benchmarks/results/s60/context-vocab-fp32.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, prompts_by_category, target_and_drafter, write_results  # noqa: E402

from anchorspec.api import DEFAULT_TREE, Engine  # noqa: E402
from anchorspec.data.chat import prompt_ids  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, generate_vanilla  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.shape import replay  # noqa: E402
from anchorspec.metrics import GenerationStats  # noqa: E402

ARMS = ("base", "prompt", "oracle")


def head_map(drafter, target_rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The least-squares map from target output rows to the drafter's head rows over the shared vocabulary,
    and the mean cosine it reaches on 1/8 of those rows left out of the fit."""
    ids, head = drafter.draft_to_target, drafter.lm_head.weight.detach().float()
    order = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
    fit, check = order[ids.numel() // 8:], order[:ids.numel() // 8]
    A = torch.linalg.lstsq(target_rows[ids[fit]], head[fit]).solution
    cos = torch.nn.functional.cosine_similarity(target_rows[ids[check]] @ A, head[check], dim=1).mean()
    return torch.linalg.lstsq(target_rows[ids], head).solution, float(cos)


def set_vocabulary(drafter, base_ids: torch.Tensor, base_head: torch.Tensor, extra: torch.Tensor,
                   extra_rows: torch.Tensor) -> None:
    """The drafter's head and d2t/t2d for base ids plus `extra` (rows in the sorted-id order d2t uses)."""
    ids = torch.cat([base_ids, extra])
    table = torch.zeros(drafter.config.vocab_size, base_head.shape[1], dtype=base_head.dtype)
    table[base_ids], table[extra] = base_head, extra_rows.to(base_head.dtype)
    drafter.resize_draft_vocab(ids.numel())
    drafter.set_vocab_mapping(ids)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(table[drafter.draft_to_target])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="checkpoints/smollm2-135m-instruct-eagle3")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--mtbench", default=DEFAULT_DATA)
    p.add_argument("--categories", default="writing,stem,humanities")
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    target, drafter = target_and_drafter(args)
    if not getattr(target.model.config, "tie_word_embeddings", False):
        raise SystemExit("this experiment reads the target's output rows from its (tied) input embedding")
    rows = target.embed_weight.detach().float()  # packing may have replaced the LM head's module, not this
    A, held_cos = head_map(drafter, rows)
    base_ids, base_head = drafter.draft_to_target.clone(), drafter.lm_head.weight.detach().clone()
    in_vocab = drafter.t2d.clone()

    gcfg = GenerationConfig(max_new_tokens=args.answer_tokens, stop_token_ids=tuple(Engine(target).stop_token_ids()))
    report = {"dtype": args.dtype, "tree": list(DEFAULT_TREE.__dict__.values()), "map_heldout_cosine": held_cos,
              "categories": {}}
    for category, asked in prompts_by_category(args.mtbench, args.per_category, args.categories).items():
        stats = {arm: GenerationStats() for arm in ARMS}
        covered = {arm: 0 for arm in ARMS}
        tokens = 0
        for q in tqdm(asked, desc=category, leave=False):
            ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
            answer = generate_vanilla(target, torch.tensor(ids), gcfg).token_ids
            seq = torch.tensor(ids + answer)
            outside_prompt = torch.tensor(sorted({t for t in ids if not in_vocab[t]}), dtype=torch.long)
            outside_all = torch.tensor(sorted({t for t in ids + answer if not in_vocab[t]}), dtype=torch.long)
            tokens += len(answer)
            for arm, extra in (("base", outside_prompt[:0]), ("prompt", outside_prompt), ("oracle", outside_all)):
                set_vocabulary(drafter, base_ids, base_head, extra, rows[extra] @ A)
                covered[arm] += int(drafter.t2d[torch.tensor(answer)].sum())
                stats[arm] = stats[arm].merge(replay(target, EagleProposer(drafter), seq, len(ids), DEFAULT_TREE))
        report["categories"][category] = {arm: {"tau": stats[arm].tau, "steps": stats[arm].verify_steps,
                                                "coverage": covered[arm] / tokens} for arm in ARMS}
    print(f"| category ({args.dtype}, {args.threads} thread(s); head map held-out cosine {held_cos:.3f}) | "
          + " | ".join(f"{arm} tau (coverage)" for arm in ARMS) + " |")
    print("|---|" + "---|" * len(ARMS))
    for category, r in report["categories"].items():
        print(f"| {category} | " + " | ".join(f"{r[a]['tau']:.2f} ({r[a]['coverage']:.3f})" for a in ARMS) + " |")
    write_results(args.out, args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
