"""Drift-aware pruning (`prune="drift"`): a draft node whose drafter state norm has grown past
DRIFT_RATIO times its context's is not expanded. Mechanics of the expansion and the indicator, and
greedy output equal to plain greedy in float64 with pruning biting (the distribution check with
sampling is in test_sampling_e2e.py)."""

import pytest
import torch

import anchorspec.decode.propose as propose
from anchorspec.decode.batch import BatchKV
from anchorspec.decode.drafting import DraftPass, run_passes
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape, build_dynamic_tree
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import KVCache
from helpers import prompts, random_drafter, tiny_target


def test_pruned_nodes_are_neither_kept_nor_expanded():
    """Candidates 0..: level 1 has tokens 10, 11; the expander prunes every node whose token is odd."""
    shape = TreeShape(2, 3, 12)
    calls = []

    def expand(nodes, toks, parents):
        calls.append(list(toks))
        children = torch.tensor([[t * 10, t * 10 + 1] for t in toks])
        logp = torch.tensor([[-0.1, -0.2]] * len(toks), dtype=torch.float64)
        return children, logp.masked_fill(torch.tensor([t % 2 == 1 for t in toks])[:, None], float("-inf"))

    tree = build_dynamic_tree(1, torch.tensor([10, 11]), torch.tensor([-0.1, -0.2]), expand, shape)
    tokens = tree.tokens.tolist()
    assert calls == [[10, 11], [100, 101]]  # 11's children were pruned; 100 and 101 made the frontier
    assert 110 not in tokens and 111 not in tokens
    assert sorted(tokens) == [1, 10, 11, 100, 101, 1000, 1001]  # 101 pruned: its children are gone
    for node, parent in enumerate(tree.parents[1:], start=1):  # closed under ancestors
        assert 0 <= parent < node

    everything_pruned = build_dynamic_tree(1, torch.tensor([11, 13]), torch.tensor([-0.1, -0.2]), expand, shape)
    assert everything_pruned.depth == 1 and everything_pruned.size == 3


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_state_norm_is_the_same_alone_and_in_a_batch(variant):
    """The indicator of a pass is the norm of the layer's raw output (the drafter's own step on a
    KVCache), alone on the proposer's own slot and on a slot of a shared BatchKV."""
    target = tiny_target("llama")
    drafter = random_drafter(target, variant)
    aux = torch.randn(5, drafter.config.target_hidden_size * 3, dtype=torch.float64)
    tokens = torch.randint(0, 64, (5,))
    alone = EagleProposer(drafter)
    (solo,) = run_passes([DraftPass(drafter, alone.cache, 0, tokens, torch.arange(5), aux=aux)])
    kv = BatchKV()
    slot = kv.attach_rows(*EagleProposer(drafter).cache_rows())
    (batched,) = run_passes([DraftPass(drafter, slot, 0, tokens, torch.arange(5), aux=aux)])
    h = drafter.step(tokens[None], drafter.project_features(aux)[None], torch.arange(5)[None],
                     KVCache()).state[0, -1]
    assert torch.allclose(solo.state_norm, h.norm().float()[None]) and torch.allclose(batched.state_norm, solo.state_norm)


def drafted(target, proposer, shape, prompt, ratio, monkeypatch, params=None):
    monkeypatch.setattr(propose, "DRIFT_RATIO", ratio)
    cfg = GenerationConfig(max_new_tokens=24, sampling=params or SamplingParams())
    return generate_speculative(target, proposer, prompt, cfg, shape)


@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(3, 4, 12)], ids=str)
def test_pruning_cuts_drafts(shape, monkeypatch):
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target), prune="drift")
    prompt = prompts()[0]
    full = drafted(target, EagleProposer(proposer.drafter), shape, prompt, 0.0, monkeypatch)
    none_pruned = drafted(target, proposer, shape, prompt, 1e9, monkeypatch)
    all_pruned = drafted(target, proposer, shape, prompt, 0.0, monkeypatch)
    assert none_pruned.token_ids == full.token_ids
    assert none_pruned.stats.drafted_tokens == full.stats.drafted_tokens
    # every node drifted: only the first level (drafted from the real context) survives
    assert len(all_pruned.stats.acceptance_per_depth) == 1
    assert all_pruned.stats.drafted_tokens == all_pruned.stats.verify_steps * shape.top_k


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [TreeShape.chain(5), TreeShape(2, 3, 6), TreeShape(8, 6, 32)], ids=str)
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_pruned_drafting_is_lossless(family, shape, variant, monkeypatch):
    """A ratio near 1 prunes some nodes and not others: output stays plain greedy's."""
    target = tiny_target(family)
    proposer = EagleProposer(random_drafter(target, variant), prune="drift")
    unpruned = EagleProposer(proposer.drafter)
    cfg = GenerationConfig(max_new_tokens=24)
    cut = 0
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        res = drafted(target, proposer, shape, prompt, 1.02, monkeypatch)
        assert res.token_ids == ref, (family, shape, variant)
        cut += drafted(target, unpruned, shape, prompt, 1.02, monkeypatch).stats.drafted_tokens - res.stats.drafted_tokens
    if shape.depth > 1:
        assert cut > 0  # the pruning really bit


def test_unknown_rule_is_a_one_line_error():
    target = tiny_target("llama")
    with pytest.raises(AnchorspecError, match="unknown pruning rule"):
        EagleProposer(random_drafter(target), prune="confidence")
