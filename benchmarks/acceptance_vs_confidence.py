#!/usr/bin/env python
"""Is a category's low tau the drafter's fault or the text's? Acceptance against the target's own confidence.

For MT-bench first turns (by category), the target answers greedily; one target forward over each
prompt + answer gives its top-1 probability at every answer position (how sure the target is of the
token it wrote). The default tree is then walked along each answer (`decode.shape.replay`, greedy, no
verify forwards), and every level a draft reached is scored: accepted or not, against the target's
confidence at that position.

Three readings per category:
- its confidence profile (mean top-1 probability, share of positions below 0.5): how predictable the
  text is to anyone;
- its first-level acceptance against what the pooled acceptance-by-confidence curve predicts for its
  positions ("expected"). Actual ~ expected: the category is hard because the target is unsure, and
  only a better drafter everywhere helps. Actual well below expected: the drafter is weak on this kind
  of text at equal target confidence, which data of that kind can fix;
- its first-level acceptance inside a word (the drafted token continues the root's word, as "ged" after
  " indul") and elsewhere: completing a rare word is lexical knowledge the target has and a one-layer
  drafter must have seen;
- the share of its answer tokens outside the drafter's draft vocabulary (d2t/t2d): those the drafter can
  never propose, so every one ends a draft. With --corpus, also the share a draft vocabulary of each
  --vocab-sizes size, chosen from the corpus as `train` chooses it, would leave out.

Several --drafter NAME=DIR share the target's answers and confidences (one process, one dtype).

    python benchmarks/acceptance_vs_confidence.py --drafter r11=checkpoints/smollm2-135m-instruct-eagle3.1 \
        --per-category 10 --out benchmarks/results/acceptance-vs-confidence/r11.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, environment, model_parser, named_drafters, warn_if_busy  # noqa: E402

from anchorspec.api import DEFAULT_TREE, Engine, attach_drafter  # noqa: E402
from anchorspec.atomic import atomic_write_text  # noqa: E402
from anchorspec.data.chat import prompt_ids  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, generate_vanilla  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.shape import replay  # noqa: E402
from anchorspec.metrics import GenerationStats  # noqa: E402
from anchorspec.models.drafter import load_drafter  # noqa: E402
from anchorspec.models.target import load_target, parse_dtype  # noqa: E402

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 1.0001)  # target top-1 probability


def bin_of(p: float) -> int:
    return next(i for i in range(len(BINS) - 1) if p < BINS[i + 1])


def first_turns(path: str, per_category: int) -> list[dict]:
    rows, seen = [], defaultdict(int)
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                cat = q.get("category", "all")
                if seen[cat] < per_category:
                    seen[cat] += 1
                    rows.append({"id": q.get("question_id"), "category": cat, "text": q["turns"][0]})
    return rows


@torch.inference_mode()
def target_confidence(target, seq: torch.Tensor) -> torch.Tensor:
    """conf[t] = the target's probability of its own top-1 token after seq[:t + 1] (float32)."""
    logits = target.forward(seq, torch.arange(seq.numel()), target.new_cache()).logits
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


def inside_word(pieces: list[str]) -> list[bool]:
    """inside[t]: token t continues token t-1's word (both sides of the join are letters, no space between)."""
    return [False] + [bool(a) and bool(b) and a[-1].isalpha() and b[0].isalpha() for a, b in zip(pieces, pieces[1:])]


def level_records(roots, conf: torch.Tensor, inside: list[bool],
                  in_vocab: list[bool]) -> list[tuple[int, float, bool, bool, bool]]:
    """(depth, target confidence, accepted, inside a word, in the draft vocabulary) for every level a step's
    draft reached: depth d is scored only if depths < d were accepted (the verifier never looks further),
    at the position it predicts."""
    out = []
    for pos, accepted, tree in roots:
        for d in range(1, min(tree.depth, accepted + 1) + 1):
            out.append((d, float(conf[pos + d - 1]), d <= accepted, inside[pos + d], in_vocab[pos + d]))
    return out


def rate(oks) -> float:
    oks = list(oks)
    return sum(oks) / len(oks) if oks else float("nan")


def summarise(records: list[tuple[int, float, bool, bool, bool]], curve: dict[int, float] | None) -> dict:
    first = [(c, ok, w, v) for d, c, ok, w, v in records if d == 1]
    by_bin: dict[int, list[bool]] = defaultdict(list)
    for c, ok, _, _ in first:
        by_bin[bin_of(c)].append(ok)
    row = {
        "first_level_steps": len(first),
        "first_level_acceptance": rate(ok for _, ok, _, _ in first),
        "first_level_by_confidence": {f"{BINS[b]:.2f}-{min(BINS[b + 1], 1.0):.2f}": [rate(v), len(v)]
                                      for b, v in sorted(by_bin.items())},
        "inside_word_share": rate(w for _, _, w, _ in first),
        "first_level_inside_word": rate(ok for _, ok, w, _ in first if w),
        "first_level_word_start": rate(ok for _, ok, w, _ in first if not w),
        "outside_vocab_share": rate(not v for _, _, _, v in first),
        "first_level_in_vocab": rate(ok for _, ok, _, v in first if v),
        # the misses where the target was sure (p >= 0.9), and how many of them the drafter could not propose
        "sure_misses": sum(1 for c, ok, _, _ in first if c >= 0.9 and not ok),
        "sure_misses_outside_vocab": sum(1 for c, ok, _, v in first if c >= 0.9 and not ok and not v),
    }
    if curve is not None and first:
        row["first_level_expected"] = sum(curve.get(bin_of(c), 0.0) for c, _, _, _ in first) / len(first)
    return row


def confidence_profile(confs: list[float]) -> dict:
    return {"positions": len(confs), "mean_confidence": sum(confs) / max(len(confs), 1),
            "share_below_0.5": sum(c < 0.5 for c in confs) / max(len(confs), 1)}


def main(argv=None) -> int:
    p = model_parser(__doc__.split("\n\n")[0], dtype="float32", dtypes=["float32", "bfloat16"], many_drafters=True)
    p.add_argument("--mtbench", default=DEFAULT_DATA)
    p.add_argument("--per-category", type=int, default=5, help="first turns per MT-bench category")
    p.add_argument("--answer-tokens", type=int, default=128, help="generate's default budget")
    p.add_argument("--corpus", default=None, help="training corpus: also score draft vocabularies of --vocab-sizes")
    p.add_argument("--vocab-sizes", default="8192,16384,24576,32768", help="comma-separated, with --corpus")
    p.add_argument("--out", required=True, help="JSON report (a PNG beside it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype)
    names, proposers, vocabs = [], [], []
    for name, path in named_drafters(args.drafter):
        drafter = load_drafter(path, dtype).eval()
        attach_drafter(target, drafter)
        names.append(name)
        proposers.append(EagleProposer(drafter))
        vocabs.append(drafter.t2d.bool().tolist())
    gcfg = GenerationConfig(max_new_tokens=args.answer_tokens, stop_token_ids=tuple(Engine(target).stop_token_ids()))

    records: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))  # name -> category -> records
    walked: dict[str, dict[str, GenerationStats]] = defaultdict(lambda: defaultdict(GenerationStats))
    confs: dict[str, list[float]] = defaultdict(list)
    answers: list[dict] = []
    for q in tqdm(first_turns(args.mtbench, args.per_category), desc="answer + replay"):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
        seq = torch.tensor(ids + generate_vanilla(target, torch.tensor(ids), gcfg).token_ids)
        conf = target_confidence(target, seq)
        inside = inside_word([target.tokenizer.decode([t]) for t in seq.tolist()])
        confs[q["category"]] += conf[len(ids) - 1:seq.numel() - 1].tolist()  # the positions that predict answer tokens
        answers.append({"id": q["id"], "category": q["category"], "prompt_tokens": len(ids),
                        "answer": seq[len(ids):].tolist()})
        for name, proposer, vocab in zip(names, proposers, vocabs):
            roots: list = []
            stats = replay(target, proposer, seq, len(ids), DEFAULT_TREE, roots=roots)
            records[name][q["category"]] += level_records(roots, conf, inside, [vocab[t] for t in seq.tolist()])
            # the drafters take turns on every answer, so their drafting times compare
            walked[name][q["category"]] = walked[name][q["category"]].merge(stats)

    report = {"environment": environment(args), "tree": list(DEFAULT_TREE.__dict__.values()), "bins": BINS[:-1],
              "drafters": dict(zip(names, args.drafter)), "categories": {c: confidence_profile(v) for c, v in confs.items()}}
    for name, vocab in zip(names, vocabs):
        for cat in confs:
            report["categories"][cat][name] = {"answer_tokens_outside_vocab": outside_share(answers, vocab, cat)}
    if args.corpus:
        report["vocab_sizes"] = vocab_size_coverage(args.corpus, target, answers,
                                                    [int(v) for v in args.vocab_sizes.split(",")])
    for name, vocab in zip(names, vocabs):
        pooled = [r for rs in records[name].values() for r in rs]
        curve = {b: rate(ok for d, c, ok, *_ in pooled if d == 1 and bin_of(c) == b) for b in range(len(BINS) - 1)}
        for cat, recs in records[name].items():
            report["categories"][cat][name].update(replayed_tau=walked[name][cat].tau, **summarise(recs, curve))
        total = GenerationStats()
        for stats in walked[name].values():
            total = total.merge(stats)
        report.setdefault("pooled", {})[name] = {"replayed_tau": total.tau, **summarise(pooled, curve),
                                                 "answer_tokens_outside_vocab": outside_share(answers, vocab, None),
                                                 "draft_ms_per_step": 1e3 * total.draft_s / max(total.verify_steps, 1)}

    print(f"{args.dtype}, {args.threads} thread(s), {args.per_category} prompts a category, {args.answer_tokens} tokens, "
          f"tree {tuple(report['tree'])}; level 1: the first draft level accepted (any of its candidates)")
    print("| category | target mean top-1 p | positions p<0.5 | drafter | replayed tau | level 1 | expected from "
          "confidence | level 1 inside a word (share) | level 1 at a word start | answer tokens outside the draft "
          "vocab | sure misses (p>=0.9) outside it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cat, r in list(report["categories"].items()) + [("all", {**confidence_profile(
            [c for cs in confs.values() for c in cs]), **report["pooled"]})]:
        for name in names:
            d = r[name]
            print(f"| {cat} | {r['mean_confidence']:.3f} | {r['share_below_0.5']:.1%} | {name} | {d['replayed_tau']:.2f} | "
                  f"{d['first_level_acceptance']:.3f} | {d['first_level_expected']:.3f} | "
                  f"{d['first_level_inside_word']:.3f} ({d['inside_word_share']:.0%}) | {d['first_level_word_start']:.3f} | "
                  f"{d['answer_tokens_outside_vocab']:.1%} | {d['sure_misses_outside_vocab']}/{d['sure_misses']} |")
    print("drafting (proposer update + propose, ms a step, same process and answers): "
          + ", ".join(f"{n} {report['pooled'][n]['draft_ms_per_step']:.1f}" for n in names))
    if args.corpus:
        sizes = report["vocab_sizes"]
        print(f"\nanswer tokens outside a draft vocabulary chosen from {args.corpus} ({sizes['corpus_loss_tokens']:,} "
              "loss tokens), by size")
        print("| category | " + " | ".join(sizes["sizes"]) + " |")
        print("|---|" + "---|" * len(sizes["sizes"]))
        for cat in list(confs) + ["all"]:
            print(f"| {cat} | " + " | ".join(f"{sizes['sizes'][k][cat]:.1%}" for k in sizes["sizes"]) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({**report, "answers": answers}, indent=1) + "\n")
    plot(report, names[0], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def outside_share(answers: list[dict], in_vocab, category: str | None) -> float:
    tokens = [t for a in answers if category in (None, a["category"]) for t in a["answer"]]
    return sum(not in_vocab[t] for t in tokens) / max(len(tokens), 1)


def vocab_size_coverage(corpus: str, target, answers: list[dict], sizes: list[int]) -> dict:
    """Answer tokens outside a draft vocabulary of each size: the corpus's most frequent loss tokens, as `train`
    picks them but without the stop tokens it forces in."""
    from anchorspec.data.corpus import read_corpus
    from anchorspec.train.vocab import count_loss_tokens, select_draft_vocab

    examples = read_corpus(Path(corpus), vocab_size=target.vocab_size)
    counts = count_loss_tokens(((e.input_ids, e.loss_mask) for e in examples), target.vocab_size)
    categories = list(dict.fromkeys(a["category"] for a in answers)) + ["all"]
    out = {"corpus_loss_tokens": int(counts.sum()), "sizes": {}}
    for size in sizes:
        keep = torch.zeros(target.vocab_size, dtype=torch.bool)
        keep[select_draft_vocab(counts, min(size, target.vocab_size))] = True
        keep = keep.tolist()
        out["sizes"][str(size)] = {cat: outside_share(answers, keep, None if cat == "all" else cat) for cat in categories}
    return out


def plot(report: dict, name: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cat, r in report["categories"].items():
        mids, acc = [], []
        for label, (share, n) in r[name]["first_level_by_confidence"].items():
            lo, hi = map(float, label.split("-"))
            if n >= 5:
                mids.append((lo + hi) / 2)
                acc.append(share)
        left.plot(mids, acc, marker="o", label=cat)
        right.bar(cat, r["share_below_0.5"])
    left.set_xlabel("target's top-1 probability at the drafted position")
    left.set_ylabel("first draft level accepted")
    left.set_title(f"Acceptance at equal target confidence ({name})")
    left.legend(fontsize=8)
    right.set_ylabel("answer positions where the target's top-1 p < 0.5")
    right.set_title("How unsure the target is, per category")
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
