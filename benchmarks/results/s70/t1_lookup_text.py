"""Lookup-only tau along T=1 answers vs greedy answers to the same prompts (point-mass proposals:
P(sampled token == chain token) = p(token) = its acceptance probability)."""
import sys, numpy as np
from anchorspec.data.corpus import read_part
from anchorspec.decode.lookup import ContextLookup, LookupSettings, common_prefix

def walk(tokens, mask):
    start = next(i for i, m in enumerate(mask) if m)  # first trained (answer) token
    ctx = ContextLookup(LookupSettings())
    pos, steps, emitted, matched = start - 1, 0, 0, 0   # pos: index of the pending token
    while pos < len(tokens) - 2:
        answer = tokens[pos + 1:]
        ctx.extend(tokens[len(ctx.tokens):pos + 1])
        chain = ctx.propose(len(answer) - 1)
        n = common_prefix(chain, answer) if chain else 0
        ctx.observe(n if chain else None)
        steps += 1; emitted += n + 1; matched += n; pos += n + 1
    return emitted, steps, matched

for spec in sys.argv[1:]:
    ex = read_part(spec)
    E = S = M = 0
    for e in ex[:800]:
        t = list(map(int, e.input_ids)); m = list(map(bool, e.loss_mask))
        if not any(m): continue
        a, s, mm = walk(t, m); E += a; S += s; M += mm
    print(spec, "conversations", min(len(ex), 800), "lookup-only tau", round(E / S, 3), "copied tok/step", round(M / S, 3))
