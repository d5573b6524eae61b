"""n-gram table drafter variant: per order, distinct n-gram -> majority next token (count >= MIN_COUNT, share >= s);
chains by re-querying with the extended context, longest order first (backoff)."""
import sys, os, time
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from tqdm import tqdm
from datastore_replay import END, ngram_hashes
from anchorspec.data.corpus import corpus_parts, read_part
from bench_core import model_parser, target_and_drafter
from anchorspec.decode.lookup import NO_MATCH_LIMIT, ContextLookup, LookupSettings, common_prefix, merge_chain
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import GREEDY, accepted_length
from anchorspec.decode.tree import TreeShape

M = 1000003
MASK = (1 << 64) - 1
def pyhash(tokens):
    h = 0
    for t in tokens:
        h = (h * M + t + 1) & MASK
    return h

class Table:
    def __init__(self, corpus, orders, min_count, min_share):
        t = time.perf_counter()
        T = np.concatenate([np.asarray(e.input_ids + [END], dtype=np.int32) for p in corpus_parts(corpus) for e in read_part(p)])
        self.orders, self.tabs = sorted(orders, reverse=True), {}
        total = 0
        for n in self.orders:
            h = ngram_hashes(T, n)[:-1]
            nxt = T[n:].astype(np.int64)
            ok = nxt != END
            h, nxt = h[ok], nxt[ok]
            order = np.lexsort((nxt, h))
            h, nxt = h[order], nxt[order]
            # runs of equal (key, next)
            new_pair = np.ones(len(h), bool); new_pair[1:] = (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])
            pstart = np.flatnonzero(new_pair)
            pcount = np.diff(np.append(pstart, len(h)))
            pkey, pnext = h[pstart], nxt[pstart]
            new_key = np.ones(len(pkey), bool); new_key[1:] = pkey[1:] != pkey[:-1]
            kstart = np.flatnonzero(new_key)
            ktotal = np.add.reduceat(pcount, kstart)
            kbest = np.maximum.reduceat(pcount, kstart)
            # index of the best pair in each key group: first pair whose count equals the group's max
            grp = np.cumsum(new_key) - 1
            is_best = pcount == kbest[grp]
            first_best = np.full(len(kstart), -1)
            idx = np.flatnonzero(is_best)
            # first occurrence per group
            g = grp[idx]
            firsts = idx[np.r_[True, g[1:] != g[:-1]]]
            keep = (kbest >= min_count) & (kbest >= min_share * ktotal)
            self.tabs[n] = (pkey[kstart][keep], pnext[firsts][keep].astype(np.int32))
            total += keep.sum()
        self.entries = int(total)
        self.build_s = time.perf_counter() - t

    def propose(self, context, limit):
        seq = list(context[-max(self.orders):])
        chain = []
        for _ in range(limit):
            for n in self.orders:
                if len(seq) < n: continue
                keys, nxt = self.tabs[n]
                k = np.uint64(pyhash(seq[-n:]))
                i = np.searchsorted(keys, k)
                if i < len(keys) and keys[i] == k:
                    tok = int(nxt[i]); break
            else:
                break
            chain.append(tok); seq.append(tok)
        return chain

def walk(proposer, seq, plen, aux, shape, store, max_tokens):
    proposer.reset()
    ctx = ContextLookup(LookupSettings())
    slimit = NO_MATCH_LIMIT
    tokens = seq.tolist()
    pos, fed, emitted, steps, rows, won, qs = plen, 0, 0, 0, 0, 0, 0.0
    while pos < len(tokens) - 2:
        answer = tokens[pos + 1:]; room = len(answer) - 1
        proposer.update(seq[:pos + 1], aux[fed:pos]); fed = pos
        tree = proposer.propose(shape.capped(room), GREEDY, None)
        ctx.extend(tokens[len(ctx.tokens):pos + 1])
        chain = ctx.propose(room)
        if chain: tree = merge_chain(tree, chain)
        without = accepted_length(tree, answer)
        r = []
        if store is not None:
            t0 = time.perf_counter()
            r = store.propose(tokens[:pos + 1], min(room, max_tokens, slimit))
            qs += time.perf_counter() - t0
            if r: tree = merge_chain(tree, r)
        n = accepted_length(tree, answer)
        ctx.observe(common_prefix(chain, answer[:n + 1]) if chain else None)
        slimit = 2 * common_prefix(r, answer[:n + 1]) + 2 if r else NO_MATCH_LIMIT
        steps, rows, emitted, won, pos = steps + 1, rows + tree.size, emitted + n + 1, won + n - without, pos + n + 1
    return np.array([emitted, steps, rows, won]), qs

p = model_parser("t", dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--configs", nargs="+", default=["4,6,8:2:0.5"])
args = p.parse_args()
target, drafter = target_and_drafter(args)
proposer = EagleProposer(drafter)
data = torch.load("/tmp/s70/replay-seqs-80.pt")
shape = TreeShape.parse("1,3,4")
for cfg in ["none"] + args.configs:
    if cfg == "none":
        store, name = None, "drafter+lookup"
    else:
        o, c, s = cfg.split(":")
        store = Table("/work/main/corpus/smollm2-135m-instruct", [int(x) for x in o.split(",")], int(c), float(s))
        name = f"table orders {o} min count {c} share {s}: {store.entries/1e6:.2f}M entries, {store.build_s:.0f}s"
    tot = np.zeros(4, dtype=np.int64); qs = 0.0
    for seq, plen, aux in data:
        got, q = walk(proposer, seq, plen, aux, shape, store, 8); tot += got; qs += q
    e, s_, r, w = tot
    print(f"{name}: tau {e/s_:.3f} rows/step {r/s_:.2f} won {w/s_:.3f} query {1e3*qs/s_:.3f} ms/step", flush=True)
