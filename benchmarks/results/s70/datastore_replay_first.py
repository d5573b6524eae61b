"""Replay: a REST-style chain from an n-gram datastore of the target's own regenerated corpus, merged with
the drafter's tree and the context-lookup chain. Estimates tau and verify rows per step (no timing)."""
import sys, time, os
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, torch
from collections import Counter
from tqdm import tqdm
from bench_core import DEFAULT_DATA, load_prompts, model_parser, target_and_drafter
from anchorspec.api import Engine
from anchorspec.data.chat import prompt_ids
from anchorspec.data.corpus import corpus_parts, _part_arrays, _part_meta
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.lookup import ContextLookup, LookupSettings, common_prefix, merge_chain, NO_MATCH_LIMIT
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import GREEDY, accepted_length, captured_states
from anchorspec.decode.tree import TreeShape

P = np.uint64(1000003)

def hashes(T, n):
    h = np.zeros(len(T) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * P + T[k:len(T) - n + 1 + k].astype(np.uint64) + np.uint64(1)
    return h  # h[i]: hash of T[i:i+n]; its continuation starts at i+n

def qhash(tokens):
    h = np.uint64(0)
    with np.errstate(over="ignore"):
        for t in tokens:
            h = h * P + np.uint64(t) + np.uint64(1)
    return h

class Datastore:
    def __init__(self, folder, parts, ns):
        t0 = time.time()
        arrs = []
        for npz in corpus_parts(f"{folder}:{parts}" if parts else folder):
            tok, off, loss = _part_arrays(npz, _part_meta(npz))
            arrs.append(tok.astype(np.int32))
        self.T = np.concatenate(arrs)
        self.ns, self.index = ns, {}
        for n in ns:
            h = hashes(self.T, n)[:-1]  # keep a continuation token
            order = np.argsort(h, kind="stable")
            self.index[n] = (h[order], order.astype(np.int64) + n)
        print(f"datastore {len(self.T)/1e6:.2f}M tokens, n={ns}, built in {time.time()-t0:.0f}s", flush=True)

    def propose(self, context, limit, min_share, max_matches=256):
        for n in sorted(self.ns, reverse=True):
            if len(context) < n: continue
            keys, starts = self.index[n]
            h = qhash(context[-n:])
            lo, hi = np.searchsorted(keys, h, "left"), np.searchsorted(keys, h, "right")
            if hi > lo:
                cand = starts[lo:min(hi, lo + max_matches)]
                cand = cand[cand + limit < len(self.T)]
                chain = []
                for d in range(limit):
                    if len(cand) == 0: break
                    nxt = self.T[cand + d]
                    v, c = Counter(nxt.tolist()).most_common(1)[0]
                    if c / len(cand) < min_share or (c < 2 and n < 4):
                        break
                    chain.append(int(v)); cand = cand[nxt == v]
                return chain
        return []

def walk(proposer, seq, plen, aux, shape, use_drafter, lookup, store, store_max, min_share):
    proposer.reset()
    ctx = ContextLookup(LookupSettings()) if lookup else None
    slimit = NO_MATCH_LIMIT
    tokens = seq.tolist()
    pos, fed, emitted, steps, rows, won = plen, 0, 0, 0, 0, 0
    while pos < len(tokens) - 2:
        answer = tokens[pos + 1:]
        room = len(answer) - 1
        if use_drafter:
            proposer.update(seq[:pos + 1], aux[fed:pos]); fed = pos
            tree = proposer.propose(shape.capped(room), GREEDY, None)
        else:
            from anchorspec.decode.tree import DraftTree
            tree = DraftTree(torch.tensor([tokens[pos]]), [-1])
        base_n = accepted_length(tree, answer)
        chain = None
        if ctx is not None:
            ctx.extend(tokens[len(ctx.tokens):pos + 1])
            chain = ctx.propose(room)
            if chain: tree = merge_chain(tree, chain)
        mid_n = accepted_length(tree, answer)
        schain = None
        if store is not None:
            schain = store.propose(tokens[:pos + 1], min(room, store_max, slimit), min_share)
            if schain: tree = merge_chain(tree, schain)
        n = accepted_length(tree, answer)
        won += n - mid_n
        if ctx is not None:
            ctx.observe(common_prefix(chain, answer[:n + 1]) if chain else None)
        if store is not None:
            slimit = NO_MATCH_LIMIT if not schain else 2 * common_prefix(schain, answer[:n + 1]) + 2
        steps, rows, emitted, pos = steps + 1, rows + tree.size, emitted + n + 1, pos + n + 1
    return np.array([emitted, steps, rows, won])

p = model_parser("ds", dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--limit", type=int, default=80)
p.add_argument("--parts", default="")
p.add_argument("--shape", default="1,3,4")
args = p.parse_args()
target, drafter = target_and_drafter(args)
proposer = EagleProposer(drafter)
cache = f"/tmp/s70/replay-seqs-{args.limit}.pt"
if os.path.exists(cache):
    data = torch.load(cache)
else:
    cfg = GenerationConfig(max_new_tokens=128, stop_token_ids=tuple(Engine(target).stop_token_ids()))
    data = []
    for q in tqdm(load_prompts(DEFAULT_DATA, args.limit), desc="answers"):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
        seq = torch.tensor(ids + generate_vanilla(target, torch.tensor(ids), cfg).token_ids)
        data.append((seq, len(ids), captured_states(target, seq)))
    torch.save(data, cache)
store = Datastore("/work/main/corpus/smollm2-135m-instruct", args.parts, (3, 4, 6, 8))
shape = TreeShape.parse(args.shape)
variants = {
    "drafter+lookup": (True, True, None, 0, 0),
    "store only L8 s.5": (False, False, store, 8, 0.5),
    "drafter+lookup+store L4 s.5": (True, True, store, 4, 0.5),
    "drafter+lookup+store L8 s.5": (True, True, store, 8, 0.5),
    "drafter+lookup+store L8 s.3": (True, True, store, 8, 0.3),
    "drafter+lookup+store L8 s.7": (True, True, store, 8, 0.7),
}
tot = {k: np.zeros(4, dtype=np.int64) for k in variants}
for seq, plen, aux in tqdm(data, desc="replay"):
    for k, v in variants.items():
        tot[k] += walk(proposer, seq, plen, aux, shape, *v)
for k, (e, s, r, w) in tot.items():
    print(f"{args.shape} {k}: tau {e/s:.3f} rows/step {r/s:.2f} store won {w/s:.3f} tok/step  (steps {s})")
