"""Batched rounds the tests share: random prompts, a mix of oracle, random and plain decodings of different shapes
and lengths (MIX), and a driver that runs them in rounds of one BatchDecoder as sequences join and finish."""

from __future__ import annotations

import torch

from anchorspec.decode.engine import PlainDecoding, SpeculativeDecoding
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
from helpers import OracleProposer, VOCAB

def make_prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


# (proposer kind, shape; None = PlainDecoding, max_new_tokens): trees, chains, plain, different lengths
MIX = [("oracle", TreeShape(3, 3, 8), 19), ("random", TreeShape(4, 4, 16), 11), ("plain", None, 14),
       ("oracle", TreeShape.chain(4), 23), ("random", TreeShape.chain(3), 9), ("oracle", TreeShape(2, 5, 10), 16)]
LENGTHS = [3, 17, 8, 1, 25, 11]


def build(target, drafter, kind, shape, prompt, cfg):
    if kind == "plain":
        return PlainDecoding(target, prompt, cfg)
    proposer = OracleProposer(target) if kind == "oracle" else EagleProposer(drafter)
    return SpeculativeDecoding(target, proposer, prompt, cfg, shape)


def speculate_flag(dec, rnd, pattern):
    """None for plain decodings; else on/off by `pattern` (a per-round drift-monitor stand-in)."""
    return None if isinstance(dec, PlainDecoding) else pattern(rnd)


def run_batched(decoder, decs, start=3, pattern=lambda r: True, every_round=None):
    """Start with `start` sequences; one more joins whenever one finishes and every 2nd round."""
    waiting, live, rnd = list(decs), [], 0
    live += [waiting.pop(0) for _ in range(min(start, len(waiting)))]
    while live or waiting:
        if waiting and (rnd % 2 == 1 or len(live) < start):
            live.append(waiting.pop(0))
        result = decoder.round([(d, speculate_flag(d, rnd, pattern)) for d in live])
        for report in result.reports:
            assert not isinstance(report, BaseException), report
        if every_round:
            every_round(result, live)
        live = [d for d in live if not d.finished]
        rnd += 1
    assert not decoder.kv.slots  # every finished sequence gave its slot back
    assert all(not kv.slots for kv in decoder.draft_kv.values())  # and its drafter slot
    return [d.result() for d in decs]
