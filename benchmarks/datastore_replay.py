#!/usr/bin/env python
"""What a chain retrieved from the target's own regenerated corpus (REST-style: an n-gram datastore) would
add to the default drafts, replayed along the target's greedy answers (no verify forwards, as
`lookup_replay.py`): tau and the verify rows a step costs, per setting. Not in the engine: this measures
whether it is worth building.

    python benchmarks/datastore_replay.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 --limit 80 \
        --corpus corpus/smollm2-135m-instruct --orders 4 6 8 --out benchmarks/results/s70/datastore-replay.json

Each step: the drafter's tree (`--shape`), the context-lookup chain merged into it (decode/lookup.py, the
default), then the datastore's chain merged too. The datastore: for the longest of `--orders` whose last
tokens occur in the corpus, the continuations of up to `--max-matches` occurrences; the chain follows their
most common next token while at least `--min-share` of those still agreeing have it, at most the adaptive
length (2 x last accepted + 2, 4 after no match; `--max-tokens`). The corpus is the target's own answers, so
its phrasing is what the target writes; none of its prompts are evaluation prompts (pack-corpus filters them).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, greedy_answers, model_parser, target_and_drafter, write_results  # noqa: E402
from lookup_replay import walk  # noqa: E402

from anchorspec.data.corpus import corpus_parts, read_part  # noqa: E402
from anchorspec.decode.lookup import NO_MATCH_LIMIT, LookupSettings, common_prefix, next_chain_length  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

END = -1  # between two conversations of the datastore
MULTIPLIER = np.uint64(1000003)  # polynomial hash of an n-gram (uint64 wraps; a collision only costs a wrong draft)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] uint64: entry i hashes tokens[i:i+n]."""
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * MULTIPLIER + (tokens[k:len(tokens) - n + 1 + k] + 1).astype(np.uint64)
    return h


class Datastore:
    """Per order n: the hashes of every n-gram of the corpus, sorted, and where each one's continuation starts."""

    def __init__(self, corpus: str, orders: list[int]):
        t = time.perf_counter()
        # conversations one after another, each followed by END, which no context contains and no chain crosses
        self.tokens = np.concatenate([np.asarray(example.input_ids + [END], dtype=np.int32)
                                      for part in corpus_parts(corpus) for example in read_part(part)])
        self.orders = sorted(orders, reverse=True)
        self.index = {}
        for n in self.orders:
            h = ngram_hashes(self.tokens, n)[:-1]  # the last n-gram has no continuation
            order = np.argsort(h, kind="stable")
            self.index[n] = (h[order], order + n)
        self.build_s = time.perf_counter() - t

    def propose(self, context: list[int], limit: int, min_share: float, max_matches: int) -> list[int]:
        for n in self.orders:
            if len(context) < n:
                continue
            keys, starts = self.index[n]
            key = ngram_hashes(np.asarray(context[-n:], dtype=np.int64), n)[0]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            matches = starts[lo:min(hi, lo + max_matches)]
            matches = matches[matches + limit < len(self.tokens)]
            chain: list[int] = []
            for d in range(limit):
                if len(matches) == 0:
                    break
                following = self.tokens[matches + d]
                token, count = Counter(following.tolist()).most_common(1)[0]
                if token == END or count < min_share * len(matches):
                    break
                chain.append(int(token))
                matches = matches[following == token]
            return chain
        return []


class RetrievedChain:
    """The datastore as `lookup_replay.walk`'s second chain source, its length adapting as the lookup chain's
    does (`next_chain_length`), at most `max_tokens`."""

    def __init__(self, store: Datastore, max_tokens: int, min_share: float, max_matches: int):
        self.store, self.max_tokens, self.min_share, self.max_matches = store, max_tokens, min_share, max_matches
        self.limit = NO_MATCH_LIMIT

    def reset(self) -> None:
        self.limit = NO_MATCH_LIMIT

    def propose(self, context: list[int], room: int) -> list[int]:
        return self.store.propose(context, min(room, self.max_tokens, self.limit), self.min_share, self.max_matches)

    def observe(self, chain: list[int], accepted: list[int]) -> None:
        self.limit = next_chain_length(common_prefix(chain, accepted) if chain else None)


def main(argv=None) -> int:
    p = model_parser(__doc__.split("\n\n")[0], dtype="bfloat16", dtypes=["float32", "bfloat16"])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--shape", default="1,3,4", metavar="TOP_K,DEPTH,TOTAL", help="the drafter's (default: the "
                   "chain generate's defaults draft most on this CPU, session 69)")
    p.add_argument("--corpus", default="corpus/smollm2-135m-instruct",
                   help="packed corpus folder, FOLDER:0030-0044 for some parts")
    p.add_argument("--orders", nargs="+", type=int, default=[4, 6, 8], help="n-gram lengths looked up, longest first")
    p.add_argument("--max-tokens", nargs="+", type=int, default=[8, 16])
    p.add_argument("--min-share", nargs="+", type=float, default=[0.5, 0.9])
    p.add_argument("--max-matches", type=int, default=256)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    target, drafter = target_and_drafter(args)
    proposer = EagleProposer(drafter)
    shape = TreeShape.parse(args.shape)
    store = Datastore(args.corpus, args.orders)
    print(f"datastore: {(store.tokens != END).sum() / 1e6:.2f}M tokens, orders {store.orders}, built in {store.build_s:.0f} s")
    settings = [("drafter + lookup", None)] + [
        (f"+ datastore, {m} tokens, share {s}", RetrievedChain(store, m, s, args.max_matches))
        for m in args.max_tokens for s in args.min_share]
    totals = {name: np.zeros(4, dtype=np.int64) for name, _ in settings}
    for sequence, prompt_len, aux in greedy_answers(target, args.data, args.limit, args.answer_tokens):
        for name, retrieved in settings:
            totals[name] += walk(proposer, sequence, prompt_len, aux, shape, LookupSettings(), retrieved)
    report = {}
    print(f"| {args.shape}, {args.dtype}, {args.threads} thread(s) | tau | verify rows a step | datastore tokens a step |")
    print("|---|---|---|---|")
    for name, (emitted, steps, rows, won) in totals.items():
        report[name] = {"tau": emitted / steps, "rows_per_step": rows / steps, "won_per_step": won / steps,
                        "steps": int(steps)}
        print(f"| {name} | {emitted / steps:.3f} | {rows / steps:.2f} | {won / steps:.3f} |")
    write_results(args.out, args, {"datastore_tokens": int((store.tokens != END).sum()), "settings": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
