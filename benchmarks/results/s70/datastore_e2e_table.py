import time
import numpy as np
import sys
sys.path.insert(0, "/work/main/benchmarks")
from datastore_replay import END, ngram_hashes
from anchorspec.data.corpus import corpus_parts, read_part
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

