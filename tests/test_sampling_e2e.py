"""Sampling through the whole speculative loop preserves the target distribution.

A tiny target with an 8-token vocabulary, a random drafter, 4 new tokens per run (the first comes
from the prefill; the next three from draft-verify steps). The empirical distribution of each
output position, and of positions 2-3 jointly, is compared with the exact target distribution
computed by enumerating every prefix. The same check with an always-accept verifier must fail.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import anchorspec.decode.verify as verify
from anchorspec.api import attach_drafter
from anchorspec.decode.engine import GenerationConfig, generate_speculative
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams, probs_from_logits
from anchorspec.decode.tree import TreeShape
from anchorspec.models.drafter import init_drafter
from anchorspec.models.target import Target
from helpers import tiny_config

V = 8
NEW = 4
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
def exact_distribution(target: Target) -> torch.Tensor:
    """P(x1..x4) by enumeration: one batched forward per depth over all prefixes."""
    joint = torch.ones([V] * 0, dtype=torch.float64)
    for depth in range(NEW):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.stack([torch.cat([PROMPT, torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        probs = probs_from_logits(target.model(ids).logits[:, -1], PARAMS)  # [V**depth, V]
        joint = joint.reshape(-1, 1) * probs
    return joint.reshape([V] * NEW)


def run_many(target, proposer, shape, n):
    samples = torch.zeros(n, NEW, dtype=torch.long)
    steps = accepted = 0
    for i in range(n):
        cfg = GenerationConfig(max_new_tokens=NEW, sampling=PARAMS, seed=10_000 + i)
        res = generate_speculative(target, proposer, PROMPT, cfg, shape)
        samples[i] = torch.tensor(res.token_ids)
        steps, accepted = steps + res.stats.verify_steps, accepted + res.stats.accepted_tokens
    return samples, accepted / steps  # mean accepted drafts per verification


def worst_p_value(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """Smallest chi-square p-value over positions 1..4 and the joint of positions 2-3."""
    n = samples.shape[0]
    checks = []
    for pos in range(NEW):
        marginal = exact.sum(dim=[d for d in range(NEW) if d != pos])
        checks.append((torch.bincount(samples[:, pos], minlength=V), marginal))
    pair = exact.sum(dim=(0, 3)).reshape(-1)
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


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_speculative_sampling_matches_target_distribution(setup, shape):
    target, proposer = setup
    samples, accepted_per_step = run_many(target, proposer, shape, 2500)
    # both verifier branches ran many times: acceptances and rejections
    assert 0.1 < accepted_per_step < 0.9 * shape.depth
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_always_accept_is_detected(setup, shape, monkeypatch):
    target, proposer = setup
    monkeypatch.setattr(verify, "acceptance_probability", lambda p, q: 1.0)
    samples, _ = run_many(target, proposer, shape, 800)
    assert worst_p_value(samples, exact_distribution(target)) < 1e-6
