#!/usr/bin/env python
"""What a context-lookup chain (decode/lookup.py) adds to a drafter's drafts, replayed along the target's
own greedy answers (no verify forwards, as `decode.shape.replay`): per draft shape and lookup setting,
tau and the verify rows a step costs. The same ContextLookup, merge and adaptive length as `generate
--lookup`; the drafter's tree is the one it would draft.

    python benchmarks/lookup_replay.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 --limit 80 \
        --shapes 1,3,4 4,4,16 --lookup 0 4 16 --out benchmarks/results/s69/lookup-replay.json

`--lookup 0` is the drafter alone. Prints one row per shape and setting, also per MT-bench category
(blocks of 10 prompts) with `--categories`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, greedy_answers, model_parser, target_and_drafter, write_results  # noqa: E402

from anchorspec.decode.lookup import ContextLookup, LookupSettings, common_prefix, merge_chain  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.shape import GREEDY, accepted_length  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def walk(proposer, sequence: torch.Tensor, prompt_len: int, aux: torch.Tensor, shape: TreeShape,
         lookup: LookupSettings | None, extra=None) -> tuple[int, int, int, int]:
    """(accepted tokens incl. each step's target token, steps, verify rows, tokens `extra`'s chain won past the
    drafter and the lookup chain) of one greedy answer. `extra` is an optional second chain source merged last
    (datastore_replay's): reset(), propose(context, room) -> chain, observe(chain, accepted tokens)."""
    proposer.reset()
    context = ContextLookup(lookup) if lookup else None
    if extra is not None:
        extra.reset()
    tokens = sequence.tolist()
    pos, fed, emitted, steps, rows, won = prompt_len, 0, 0, 0, 0, 0
    while pos < len(tokens) - 2:  # as in generation, the last token comes from a plain step
        answer = tokens[pos + 1:]
        room = len(answer) - 1
        proposer.update(sequence[:pos + 1], aux[fed:pos])
        fed = pos
        tree = proposer.propose(shape.capped(room), GREEDY, None)
        chain = None
        if context is not None:
            context.extend(tokens[len(context.tokens):pos + 1])
            chain = context.propose(room)
            if chain:
                tree = merge_chain(tree, chain)
        n = accepted_length(tree, answer)
        if extra is not None:
            more = extra.propose(tokens[:pos + 1], room)
            if more:
                tree = merge_chain(tree, more)
                n, without = accepted_length(tree, answer), n
                won += n - without
            extra.observe(more, answer[:n + 1])
        if context is not None:
            context.observe(common_prefix(chain, answer[:n + 1]) if chain else None)
        steps, rows, emitted, pos = steps + 1, rows + tree.size, emitted + n + 1, pos + n + 1
    return emitted, steps, rows, won


def main(argv=None) -> int:
    p = model_parser(__doc__.split("\n\n")[0], dtype="bfloat16", dtypes=["float32", "bfloat16"])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--shapes", nargs="+", default=["1,3,4", "4,4,16"], metavar="TOP_K,DEPTH,TOTAL")
    p.add_argument("--lookup", nargs="+", type=int, default=[0, 4, 16], metavar="TOKENS",
                   help="longest lookup chain per run; 0: the drafter alone")
    p.add_argument("--categories", action="store_true", help="also a row per MT-bench category (10 prompts each)")
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    target, drafter = target_and_drafter(args)
    proposer = EagleProposer(drafter)
    shapes = [TreeShape.parse(s) for s in args.shapes]
    totals: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for i, (sequence, prompt_len, aux) in enumerate(greedy_answers(target, args.data, args.limit, args.answer_tokens)):
        groups = ["all"] + ([CATEGORIES[i // 10]] if args.categories and i // 10 < len(CATEGORIES) else [])
        for shape in shapes:
            for tokens in args.lookup:
                got = walk(proposer, sequence, prompt_len, aux, shape, LookupSettings(tokens) if tokens else None)
                for group in groups:
                    row = totals[group][f"{shape.top_k},{shape.depth},{shape.total_tokens} lookup {tokens}"]
                    for k in range(3):  # the fourth count is an extra chain's, which this script has none of
                        row[k] += got[k]
    report = {}
    print(f"| prompts ({args.dtype}, {args.threads} thread(s), {args.answer_tokens} answer tokens) | shape, lookup "
          "| tau | verify rows a step |")
    print("|---|---|---|---|")
    for group, rows in totals.items():
        for name, (emitted, steps, verify_rows) in rows.items():
            report.setdefault(group, {})[name] = {"tau": emitted / steps, "rows_per_step": verify_rows / steps,
                                                  "steps": steps}
            print(f"| {group} | {name} | {emitted / steps:.3f} | {verify_rows / steps:.2f} |")
    write_results(args.out, args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
