"""Staged verification (`staged=S`): the first S levels of a draft are verified, the deeper levels only
when the accepted path reaches them. Greedy output equals plain greedy in float64 (random and oracle
drafters, chains and trees, two families, stop tokens, the token limit); the distribution check with
sampling is in test_sampling_e2e.py."""

import pytest
import torch

from anchorspec.decode.adaptive import AdaptiveDepth
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import DraftTree, TreeShape
from anchorspec.errors import AnchorspecError
from helpers import OracleProposer, prompts, random_drafter, tiny_target


def test_levels_and_subtree_keep_structure_and_draft_probs():
    #        0
    #      1   2
    #     3 4   5
    #     6
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), [-1, 0, 0, 1, 1, 2, 3],
                     draft_probs=torch.arange(7 * 3, dtype=torch.float64).view(7, 3))
    top, kept = tree.levels(1)
    assert kept == [0, 1, 2] and top.parents == [-1, 0, 0] and top.tokens.tolist() == [10, 11, 12]
    assert tree.levels(3)[0] is tree and tree.levels(3)[1] == list(range(7))
    assert tree.levels(0)[0].size == 1
    sub = tree.subtree(1)
    assert sub.tokens.tolist() == [11, 13, 14, 16] and sub.parents == [-1, 0, 0, 1]
    assert sub.draft_probs[0].eq(0).all()  # a root is not a draft
    assert torch.equal(sub.draft_probs[1:], tree.draft_probs[[3, 4, 6]])
    assert tree.subtree(5).size == 1


def run_staged(target, proposer, prompt, cfg, shape, staged):
    dec = SpeculativeDecoding(target, proposer, prompt, cfg, shape, staged)
    reports = []
    while not dec.finished:
        reports.append(dec.step())
    return dec.result(), reports


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(3, 4, 12), TreeShape(8, 6, 32)], ids=str)
@pytest.mark.parametrize("staged", [1, 2])
def test_staged_greedy_is_lossless(family, shape, staged):
    target = tiny_target(family)
    cfg = GenerationConfig(max_new_tokens=24)
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        for proposer in (OracleProposer(target), EagleProposer(random_drafter(target))):
            res, reports = run_staged(target, proposer, prompt, cfg, shape, staged)
            assert res.token_ids == ref, (family, shape, staged, type(proposer).__name__)
            assert all(r.depth <= max(staged, shape.depth - staged - 1) for r in reports if r.kind == "speculative")
            if isinstance(proposer, OracleProposer):  # everything is accepted: the held levels are always used
                assert any(r.held for r in reports)


def test_oracle_chain_is_verified_in_two_stages():
    """An oracle chain of 4, staged at 1: the target verifies d1 (bonus d2), then d3 and d4 under the
    held root d2 with no drafting: 5 tokens per two forwards, one draft per two steps."""
    target = tiny_target("llama")
    proposer = OracleProposer(target)
    drafts = []
    propose = proposer.propose
    proposer.propose = lambda *a: drafts.append(1) or propose(*a)
    cfg = GenerationConfig(max_new_tokens=1 + 3 * 5)
    prompt = prompts()[0]
    res, reports = run_staged(target, proposer, prompt, cfg, TreeShape.chain(4), staged=1)
    assert res.token_ids == generate_vanilla(target, prompt, cfg).token_ids
    steps = [r for r in reports if r.kind == "speculative"]
    assert [(r.depth, r.accepted, r.held) for r in steps] == [(1, 1, False), (2, 2, True)] * 3
    assert len(drafts) == 3
    assert res.stats.target_forwards == 1 + 6


@pytest.mark.parametrize("max_new", [2, 3, 4, 6, 9])
def test_held_levels_respect_the_token_limit(max_new):
    target = tiny_target("llama")
    prompt = prompts()[0]
    cfg = GenerationConfig(max_new_tokens=max_new)
    ref = generate_vanilla(target, prompt, cfg).token_ids
    for shape in (TreeShape.chain(5), TreeShape(3, 5, 14)):
        res, _ = run_staged(target, OracleProposer(target), prompt, cfg, shape, staged=1)
        assert res.token_ids == ref and res.finish_reason == "length"


def test_stop_token_inside_held_levels():
    target = tiny_target("llama")
    prompt = prompts()[0]
    free = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    stop = free[4]
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,))
    ref = generate_vanilla(target, prompt, cfg)
    for staged in (1, 2):
        res, _ = run_staged(target, OracleProposer(target), prompt, cfg, TreeShape.chain(6), staged)
        assert res.token_ids == ref.token_ids and res.finish_reason == "stop"


def test_bad_staged_settings_are_one_line_errors():
    target = tiny_target("llama")
    proposer = OracleProposer(target)
    cfg = GenerationConfig(max_new_tokens=4)
    with pytest.raises(AnchorspecError, match="at least 1 level"):
        generate_speculative(target, proposer, prompts()[0], cfg, TreeShape.chain(3), staged=0)
    with pytest.raises(AnchorspecError, match="adaptive"):
        generate_speculative(target, proposer, prompts()[0], cfg, AdaptiveDepth(TreeShape.chain(3)), staged=1)
