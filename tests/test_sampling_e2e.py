"""Sampling through the whole speculative loop preserves the target distribution.

A tiny target with an 8-token vocabulary, a random drafter, 4 new tokens per run (the first comes
from the prefill; the next three from draft-verify steps). The empirical distribution of each
output position, and of positions 2-3 jointly, is compared with the exact target distribution
computed by enumerating every prefix. The same check with an always-accept verifier must fail.
"""

import pytest
import torch

import anchorspec.decode.verify as verify
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_speculative
from anchorspec.decode.lookup import LookupSettings
from anchorspec.decode.tree import TreeShape
from sampling_world import NEW, PARAMS, PROMPT, exact_distribution, run_many, setup, worst_p_value  # noqa: F401 (setup: a fixture)


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_speculative_sampling_matches_target_distribution(setup, shape):
    target, proposer = setup
    samples, stats = run_many(target, proposer, shape, 2500)
    # both verifier branches ran many times: acceptances and rejections
    assert 0.1 < stats.accepted_tokens / stats.verify_steps < 0.9 * shape.depth
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_always_accept_is_detected(setup, shape, monkeypatch):
    target, proposer = setup
    monkeypatch.setattr(verify, "acceptance_probability", lambda p, q: 1.0)
    samples, _ = run_many(target, proposer, shape, 800)
    assert worst_p_value(samples, exact_distribution(target)) < 1e-6


# single-token matches: in 4 + 4 tokens of an 8-token vocabulary a copied chain is proposed at most steps
SAMPLED_LOOKUP = LookupSettings(max_tokens=3, min_match=1, max_match=2)


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_sampling_with_a_lookup_chain_matches_target_distribution(setup, shape):
    """A chain copied from the sequence merged into sampled drafts: its tokens are fixed candidates."""
    target, proposer = setup
    samples, stats = run_many(target, proposer, shape, 2500, lookup=SAMPLED_LOOKUP)
    # copied rows were verified, and won tokens past the drafter's (rarely: this target is close to uniform, which
    # is also why a verifier that tests them with q moves the output too little to detect here; that negative
    # control is test_verify.py's, on a target and drafter that disagree)
    assert stats.lookup_rows > 1000 and stats.lookup_tokens > 25
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


STAGED_NEW = 5  # a held level needs room: one stage-1 level, its bonus, then at least one held draft


def held_steps(target, proposer, shape, n):
    """How many of n staged runs verified a held-back subtree."""
    count = 0
    for i in range(n):
        cfg = GenerationConfig(max_new_tokens=STAGED_NEW, sampling=PARAMS, seed=10_000 + i)
        dec = SpeculativeDecoding(target, proposer, PROMPT, cfg, shape, staged=1)
        while not dec.finished:
            count += dec.step().held
    return count


# a random drafter's level-2 node has drafted children in a tree only if it made the frontier: a wide tree
STAGED_SHAPES = [TreeShape.chain(3), TreeShape(8, 3, 40)]


@pytest.mark.parametrize("shape", STAGED_SHAPES, ids=["chain", "tree"])
def test_staged_verification_matches_target_distribution(setup, shape):
    """Staged at one level: level 2 is accepted from level 1's rows, and what was drafted below an
    accepted level-2 node is verified by the next forward without new drafting."""
    target, proposer = setup
    assert held_steps(target, proposer, shape, 200) > 15  # the held-back path really runs
    samples, _ = run_many(target, proposer, shape, 2500, staged=1, new=STAGED_NEW)
    assert worst_p_value(samples, exact_distribution(target, STAGED_NEW)) > 1e-3


@pytest.mark.parametrize("shape", STAGED_SHAPES, ids=["chain", "tree"])
def test_staged_level_accepted_untested_is_detected(setup, shape, monkeypatch):
    """Negative control: a level-2 node taken as the next token without the target's test (the
    level below the forwarded rows must still be verified)."""
    import anchorspec.decode.engine as engine
    from anchorspec.decode.verify import Verdict

    target, proposer = setup
    verify = engine._verify

    def untested(tree, logits, params, gen):
        verdict = verify(tree, logits, params, gen)
        end = verdict.path[-1]
        if verdict.held is None and tree.size > logits.shape[0] and tree.depths[end] == 1 and tree.children[end]:
            child = tree.children[end][0]
            return Verdict(verdict.path, int(tree.tokens[child]), held=child)
        return verdict

    monkeypatch.setattr(engine, "_verify", untested)
    samples, _ = run_many(target, proposer, shape, 800, staged=1, new=STAGED_NEW)
    assert worst_p_value(samples, exact_distribution(target, STAGED_NEW)) < 1e-6


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_drift_pruned_sampling_matches_target_distribution(setup, shape, monkeypatch):
    """Pruning shortens drafts from the drafter's own state, before the target sees them: lossless."""
    import anchorspec.decode.propose as propose

    target, proposer = setup
    plain_drafts = sum(generate_speculative(target, proposer, PROMPT, GenerationConfig(
        max_new_tokens=NEW, sampling=PARAMS, seed=i), shape).stats.drafted_tokens for i in range(50))
    monkeypatch.setattr(propose, "DRIFT_RATIO", 0.9)  # this random drafter's states sit at 0.7-1.15x its context's
    monkeypatch.setattr(proposer, "prune", "drift")
    pruned_drafts = sum(generate_speculative(target, proposer, PROMPT, GenerationConfig(
        max_new_tokens=NEW, sampling=PARAMS, seed=i), shape).stats.drafted_tokens for i in range(50))
    assert pruned_drafts < 0.9 * plain_drafts  # the pruning bites
    samples, _ = run_many(target, proposer, shape, 2500)
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


@pytest.mark.parametrize("shape, options", [
    (TreeShape.chain(3), {}), (TreeShape(3, 3, 8), {}), (TreeShape(3, 3, 8), {"lookup": SAMPLED_LOOKUP}),
    (TreeShape(8, 3, 40), {"staged": 1, "new": STAGED_NEW})], ids=["chain", "tree", "lookup", "staged"])
def test_round_samples_equal_solo_samples(setup, shape, options):
    """The distribution tests run their seeds in batched rounds (run_many): per seed, the same tokens as alone."""
    target, proposer = setup
    solo, solo_stats = run_many(target, proposer, shape, 100, batch=1, **options)
    rounds, round_stats = run_many(target, proposer, shape, 100, batch=30, **options)
    assert torch.equal(rounds, solo)
    counts = (solo_stats.accepted_tokens, solo_stats.verify_steps)
    assert (round_stats.accepted_tokens, round_stats.verify_steps) == counts
    assert solo_stats.accepted_tokens > 0
