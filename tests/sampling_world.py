"""The tiny sampled world the distribution tests share: a float64 Llama over 8 tokens with a random EAGLE-3.1
drafter (the module-scoped `setup` fixture), the exact distribution of its next NEW tokens at PARAMS by
enumeration, seeded runs, and the worst chi-square p-value of samples against the exact distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from anchorspec.api import attach_drafter
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_speculative
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams, probs_from_logits
from anchorspec.models.drafter import init_drafter
from anchorspec.models.target import Target
from batch_world import run_batched
from helpers import tiny_config

V = 8
NEW = 4
BATCH = 50  # sequences per batched run (run_many)
PROMPT = torch.tensor([1, 5, 2, 7])
PARAMS = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def setup():
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=V, layers=4))
    target = Target(model.to(torch.float64).eval())
    drafter = init_drafter(target.config, "eagle3.1", seed=5, init_std=0.3).to(torch.float64)
    attach_drafter(target, drafter)
    return target, EagleProposer(drafter)


@torch.inference_mode()
def exact_distribution(target: Target, new: int = NEW) -> torch.Tensor:
    """P(x1..x_new) by enumeration: one batched forward per depth over all prefixes."""
    joint = torch.ones([V] * 0, dtype=torch.float64)
    for depth in range(new):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.stack([torch.cat([PROMPT, torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        probs = probs_from_logits(target.model(ids).logits[:, -1], PARAMS)  # [V**depth, V]
        joint = joint.reshape(-1, 1) * probs
    return joint.reshape([V] * new)


def config(i: int, new: int = NEW, first_seed: int = 10_000) -> GenerationConfig:
    """The i-th seeded run's settings: `new` tokens at PARAMS, seed first_seed + i."""
    return GenerationConfig(max_new_tokens=new, sampling=PARAMS, seed=first_seed + i)


def collect(results, n, new=NEW):
    """The samples [n, new] of n generation results and their stats merged."""
    samples, stats = torch.zeros(n, new, dtype=torch.long), None
    for i, res in enumerate(results):
        samples[i] = torch.tensor(res.token_ids)
        stats = res.stats if stats is None else stats.merge(res.stats)
    return samples, stats


def seeded_runs(generate, n, new=NEW, first_seed=10_000):
    """n generations `generate(cfg)` of `new` tokens at PARAMS, seeded first_seed + i: the samples [n, new] and
    the runs' stats merged."""
    return collect((generate(config(i, new, first_seed)) for i in range(n)), n, new)


def run_many(target, proposer, shape, n, staged=None, new=NEW, lookup=None, batch=BATCH):
    """n seeded speculative generations: alone (batch 1: seeded_runs), or `batch` at a time in the rounds of one
    BatchDecoder (batch_world.run_batched), each sequence with its own copy of `proposer` (drafter and pruning rule).
    Per sequence a round's draws are its solo run's (test_round_samples_equal_solo_samples), so both give the
    same samples [n, new] and merged stats; rounds only share the target's forwards among the sequences."""
    if batch == 1:
        return seeded_runs(lambda cfg: generate_speculative(target, proposer, PROMPT, cfg, shape, staged=staged,
                                                            lookup=lookup), n, new)
    results = []
    for first in range(0, n, batch):
        decs = [SpeculativeDecoding(target, EagleProposer(proposer.drafter, prune=proposer.prune), PROMPT,
                                    config(i, new), shape, staged, lookup) for i in range(first, min(n, first + batch))]
        results += run_batched(BatchDecoder(target), decs, start=len(decs))
    return collect(results, n, new)


def worst_p_value(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """Smallest chi-square p-value over each position and the joint of positions 2-3."""
    n, new = samples.shape
    checks = []
    for pos in range(new):
        marginal = exact.sum(dim=[d for d in range(new) if d != pos])
        checks.append((torch.bincount(samples[:, pos], minlength=V), marginal))
    pair = exact.sum(dim=[d for d in range(new) if d not in (1, 2)]).reshape(-1)
    checks.append((torch.bincount(samples[:, 1] * V + samples[:, 2], minlength=V * V), pair))
    worst = 1.0
    for observed, p in checks:
        expected = p * n
        if (observed[expected == 0] > 0).any():
            return 0.0  # a token the target can never produce
        big = expected >= 5  # pool rare cells into one so the chi-square approximation holds
        obs = torch.cat([observed[big].double(), observed[~big].double().sum().view(1)])
        exp = torch.cat([expected[big], expected[~big].sum().view(1)])
        keep = exp > 0
        worst = min(worst, float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue))
    return worst
