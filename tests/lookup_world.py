"""What the context-lookup tests share: prompts with loops in them, sampled lookup settings, the batched prompts
and budgets, a driver of BatchDecoder rounds, and a target whose greedy output stops inside a copied cycle."""

from __future__ import annotations

import torch

from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_vanilla
from anchorspec.decode.lookup import LookupSettings
from anchorspec.decode.round import BatchDecoder
from helpers import tiny_target

# a loop in the prompt, and one the tiny targets fall into on their own (their greedy outputs cycle)
PROMPTS = [torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5]), torch.arange(1, 11)]
SINGLE = LookupSettings(min_match=1)  # sampled text repeats single tokens, rarely pairs
# the batched rounds: three sequences of different shapes and lengths
BATCH_PROMPTS = [PROMPTS[0], PROMPTS[1], torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])]
BATCH_TOKENS = (30, 17, 25)


def stop_inside_a_cycle():
    """granite, a prompt and a config whose plain greedy output stops inside a repetition the lookup copies:
    the prompt holds granite's 5-token greedy cycle once and a half, so the lookup proposes it and the
    second step's chain runs six tokens deep, and the cycle's fifth token, never emitted before, is the stop.
    Returns (target, prompt, cfg, the plain result)."""
    target = tiny_target("granite")
    free = generate_vanilla(target, PROMPTS[0], GenerationConfig(max_new_tokens=20)).token_ids
    cycle = free[4:9]  # granite's greedy output settles into a 5-token cycle
    assert free[9:19] == cycle * 2
    prompt = torch.cat([PROMPTS[0], torch.tensor(free[:13])])
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(free[13 + 4],))
    ref = generate_vanilla(target, prompt, cfg)
    assert ref.finish_reason == "stop" and len(ref.token_ids) == 5
    return target, prompt, cfg, ref


def in_rounds(target, decs: list[SpeculativeDecoding], chains=None) -> list[SpeculativeDecoding]:
    """Step `decs` in rounds of one BatchDecoder, speculating, until all finish (no row may fail); `chains`:
    BatchDecoder.round's cap on copied chains."""
    decoder = BatchDecoder(target)
    while not all(d.finished for d in decs):
        result = decoder.round([(d, True) for d in decs if not d.finished], chains=chains)
        assert not any(isinstance(r, BaseException) for r in result.reports)
    return decs
