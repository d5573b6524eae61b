#!/usr/bin/env python
"""Where does a drafter accept? The default tree walked (`decode.shape.replay`, greedy, no verify
forwards) along the first `--answer-tokens` tokens of answers from each source:

- held-out corpus answers (never trained on: train's own seeded split), one row per prompt source
  (ShareGPT, GSM8K train, AlpacaEval, Magpie, ShareGPT later turns);
- MT-bench first turns, answered greedily by the target here, in the same dtype; with
  `--mtbench-categories`, one row per category (MT-bench lists them in blocks of 10).

Steered Magpie prompts (`scripts/steered_magpie.sh`) get one row per steer, named from
`scripts/magpie_steers.sh`, so a steer's held-out answers sit beside the MT-bench category it aims at.

Replayed tau is what greedy speculation with that tree reaches on that text, so the rows say whether
a gap between held-out and MT-bench tau is the drafter (it is the same everywhere) or the prompts
(a source the corpus lacks). One process, one dtype, the same drafter for every row.

    python benchmarks/replay_by_source.py --drafter eagle3.1=checkpoints/smollm2-135m-instruct-eagle3.1 \
        --out benchmarks/results/replay-by-source/r6.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, load_prompts, named_drafters, prompts_by_category, write_results  # noqa: E402

from anchorspec.bench.workloads import expand_workloads, load_workload  # noqa: E402
from anchorspec.api import DEFAULT_TREE, Engine, attach_drafter  # noqa: E402
from anchorspec.data.chat import prompt_ids  # noqa: E402
from anchorspec.data.corpus import read_corpus  # noqa: E402
from anchorspec.data.magpie import id_prefix  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, generate_vanilla  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.shape import captured_states, replay  # noqa: E402
from anchorspec.metrics import GenerationStats  # noqa: E402
from anchorspec.models.drafter import load_drafter  # noqa: E402
from anchorspec.models.target import load_target, parse_dtype  # noqa: E402
from anchorspec.data.chat import first_answer  # noqa: E402
from anchorspec.train.dataset import split_heldout  # noqa: E402

SOURCE_NAMES = {"sharegpt": "ShareGPT first turns", "train.jsonl": "GSM8K train", "outputs.json": "AlpacaEval",
                "magpie.jsonl": "Magpie (the target's own prompts)", "later": "ShareGPT later turns"}


def steer_names(steers_script: Path) -> dict[str, str]:
    """`magpie-<hash>` -> "Magpie, <name> steer" for every steer in scripts/magpie_steers.sh."""
    names = {}
    for line in steers_script.read_text().splitlines() if steers_script.exists() else []:
        m = re.match(r'\s*\[(\w+)\]="(.*)"\s*$', line)
        if m and m.group(2):
            names[id_prefix(0, m.group(2)).rsplit(":", 1)[0]] = f"Magpie, {m.group(1)} steer"
    return names


def source_name(source: str, steers: dict[str, str]) -> str:
    """A row name for a conversation's source: its id without the draw (`magpie-<hash>:<seed>` for Magpie)."""
    steer = source.split(":", 1)[0]
    if steer in steers:
        return steers[steer]
    return SOURCE_NAMES.get("magpie.jsonl" if source.startswith("magpie") else source, source)


def corpus_sources(folder: Path) -> list[str]:
    """The prompt source of every corpus conversation, in read_corpus order (from each part's ids)."""
    out = []
    for meta_path in sorted(folder.glob("part-*.json")):
        meta = json.loads(meta_path.read_text())
        for rid in meta.get("ids") or ["unknown"] * meta["conversations"]:
            out.append("later" if rid.endswith("#later") else rid.rsplit(":", 1)[0])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--corpus", default="corpus/smollm2-135m-instruct")
    p.add_argument("--mtbench", default=DEFAULT_DATA)
    p.add_argument("--per-source", type=int, default=16, help="answers per row")
    p.add_argument("--mtbench-categories", nargs="?", const="all", default=None, metavar="LIST",
                   help="one MT-bench row per category (--per-source first turns each, at most 10); "
                        "a comma-separated LIST keeps only those categories")
    p.add_argument("--prompts", action="append", default=[], metavar="NAME=FILE",
                   help="a row of prompts answered by the target here, as MT-bench's are (JSONL with a 'prompt' "
                        "or 'text' field, e.g. synth-prompts output): how far a candidate prompt source sits from "
                        "MT-bench before its answers are regenerated at scale")
    p.add_argument("--workloads", default=None, metavar="LIST",
                   help="also a row per `anchorspec bench` workload (e.g. 'long' or 'long-1k,sum'), first turns "
                        "answered here: --per-source prompts each")
    p.add_argument("--no-corpus", action="store_true", help="leave out the held-out corpus rows")
    p.add_argument("--answer-tokens", type=int, default=128, help="answer tokens walked (generate's default budget)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heldout", type=float, default=0.02, help="train's --heldout (the same examples)")
    p.add_argument("--seed", type=int, default=0, help="train's --seed (the same examples)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype)

    rows: dict[str, list[tuple[list[int], int]]] = defaultdict(list)
    folder = Path(args.corpus)
    examples = [] if args.no_corpus else read_corpus(folder, vocab_size=target.vocab_size)
    sources = corpus_sources(folder) if examples else []
    if len(sources) != len(examples):
        raise SystemExit(f"{folder}: {len(examples)} conversations but {len(sources)} ids in the part metadata")
    held = split_heldout([e.input_ids for e in examples], args.heldout, args.seed, minimum=2)[1] if examples else []
    steers = steer_names(Path(__file__).resolve().parent.parent / "scripts" / "magpie_steers.sh")
    for i in held:
        got = first_answer(examples[i].input_ids, examples[i].loss_mask)
        src = source_name(sources[i], steers)
        if got is None or len(got[0]) - got[1] < 3 or len(rows[src]) >= args.per_source:
            continue
        seq, start = got
        rows[src].append((seq[:start + args.answer_tokens], start))

    # MT-bench first turns, answered by the target itself (what generate would write)
    gcfg = GenerationConfig(max_new_tokens=args.answer_tokens, stop_token_ids=tuple(Engine(target).stop_token_ids()))
    if args.mtbench_categories:
        asked = [(f"MT-bench {c} (the target's answers)", q) for c, qs in
                 prompts_by_category(args.mtbench, args.per_source, args.mtbench_categories).items() for q in qs]
    else:
        asked = [("MT-bench first turns (the target's answers)", q)
                 for q in load_prompts(args.mtbench, args.per_source)]
    for spec in args.prompts:
        name, sep, path = spec.rpartition("=")  # a name may hold "=" (T=1), a path rarely does
        if not sep:
            raise SystemExit(f"--prompts takes NAME=FILE, got {spec!r}")
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        asked += [(f"{name} (the target's answers)", {"text": r.get("prompt", r.get("text"))})
                  for r in lines[:args.per_source]]
    for name in expand_workloads(args.workloads) if args.workloads else []:
        prompts = load_workload(name, args.per_source, target.tokenizer, Path(args.mtbench).parents[1],
                                context=target.model.config.max_position_embeddings, max_new_tokens=args.answer_tokens)
        asked += [(f"{name} (the target's answers)", {"text": q.turns[0]}) for q in prompts]
    for row, q in tqdm(asked, desc="answers", leave=False):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
        answer = generate_vanilla(target, torch.tensor(ids), gcfg).token_ids
        rows[row].append((ids + answer, len(ids)))
    # the target's captured states of each answer, once for every drafter (a long prompt's forward is most of a walk)
    aux_of: dict[tuple[str, int], torch.Tensor] = {}

    report = {"dtype": args.dtype, "tree": list(DEFAULT_TREE.__dict__.values()),
              "answer_tokens": args.answer_tokens, "rows": {}}
    for name, path in named_drafters(args.drafter):
        drafter = load_drafter(path, dtype).eval()
        attach_drafter(target, drafter)
        proposer = EagleProposer(drafter)
        for src, answers in rows.items():
            walked = GenerationStats()
            for k, (seq, start) in enumerate(tqdm(answers, desc=f"{name} {src}", leave=False)):
                if (src, k) not in aux_of:
                    aux_of[src, k] = captured_states(target, torch.tensor(seq))
                walked = walked.merge(replay(target, proposer, torch.tensor(seq), start, DEFAULT_TREE,
                                             aux=aux_of[src, k]))
            # answer tokens outside the draft vocabulary can never be accepted: a ceiling the data cannot lift
            walked_tokens = torch.cat([torch.tensor(seq[start:]) for seq, start in answers])
            report["rows"].setdefault(src, {"answers": len(answers)})[name] = {
                "tau": walked.tau, "steps": walked.verify_steps, "acceptance_per_depth": walked.acceptance_per_depth,
                "draft_vocab_coverage": float(drafter.t2d[walked_tokens].float().mean())}

    names = [name for name, _ in named_drafters(args.drafter)]
    print(f"| source ({args.dtype}, {args.threads} thread(s), first {args.answer_tokens} answer tokens) | answers | "
          + " | ".join(f"{n} tau" for n in names) + " | coverage |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for src, r in report["rows"].items():
        print(f"| {src} | {r['answers']} | " + " | ".join(f"{r[n]['tau']:.2f}" for n in names)
              + " | " + " / ".join(f"{r[n]['draft_vocab_coverage']:.3f}" for n in names) + " |")
    write_results(args.out, args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
