"""Sampled trees (T > 0, a tree shape): the root's top_k candidates drawn from q without replacement, a sampled
chain below each, every node's parent q kept for recursive rejection (decode/verify.py). The structure
never depends on a draw's value; the distribution checks are in test_verify.py (the verifier alone) and
test_sampling_e2e.py (the whole loop)."""

import torch

from anchorspec.decode.engine import GenerationConfig, generate_speculative
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams, sample_without_replacement
from anchorspec.decode.tree import TreeShape, sampled_tree
from anchorspec.decode.program import run
from helpers import prompts, random_drafter, tiny_target

NEG = float("-inf")


def test_draws_without_replacement_follow_q_in_draw_order():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_without_replacement(q, 3, g) for _ in range(6000)])
    assert all(len(set(row.tolist())) == 3 for row in draws[:50])  # no token twice
    assert (draws[:, :2] != 3).all()  # the zero-probability token only ever comes last
    first = torch.bincount(draws[:, 0], minlength=4) / 6000
    assert torch.allclose(first, q.float(), atol=0.02)  # the first draw is a draw from q
    # the second, given the first was 0: q without it, renormalised (0.6, 0.4)
    after0 = draws[draws[:, 0] == 0, 1]
    assert abs(float((after0 == 1).double().mean()) - 0.6) < 0.03


def test_every_draw_is_kept_and_every_chain_is_as_deep():
    q0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    requests = []

    def expand(request):
        tips, toks, parents = request
        requests.append(list(toks))
        children = torch.tensor([[t * 10] for t in toks])
        logp = torch.tensor([[NEG if t == 3 else -0.5] for t in toks])  # the chain under token 3 is pruned
        return children, logp, torch.stack([q0 * (1 + t) for t in toks])

    # three draws (the fourth had no mass), 3 x 3 + 1 = 10 rows: depth 3 of the asked 5
    tree = run(sampled_tree(9, torch.tensor([2, 3, 1, 0]), torch.tensor([-1.6, -1.2, -0.9, NEG]), q0,
                            TreeShape(3, 5, 11)), expand)
    assert requests == [[2, 3, 1], [20, 10]]
    assert tree.tokens.tolist() == [9, 2, 3, 1, 20, 10, 200, 100]
    assert tree.parents == [-1, 0, 0, 0, 1, 3, 4, 5]
    assert tree.depth_ordered and tree.depth == 3
    # each node's row is the q it was drawn from: the root's for level 1, its parent's below
    assert torch.equal(tree.draft_probs[1], q0) and torch.equal(tree.draft_probs[3], q0)
    assert torch.equal(tree.draft_probs[4], q0 * 3) and torch.equal(tree.draft_probs[6], q0 * 21)
    assert not tree.draft_probs[0].any()


def test_the_proposer_drafts_sampled_trees_at_t1_and_top_k_trees_greedily():
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target))
    shape = TreeShape(3, 3, 10)
    prompt = prompts(1)[0]
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0), seed=4)
    trees = []
    real = proposer.propose_passes

    def recording(*args):
        tree = yield from real(*args)
        trees.append(tree)
        return tree

    proposer.propose_passes = recording
    first = generate_speculative(target, proposer, prompt, cfg, shape).token_ids
    sampled = list(trees)
    assert generate_speculative(target, proposer, prompt, cfg, shape).token_ids == first  # seeded
    for tree in sampled:
        assert tree.draft_probs is not None and tree.size <= 10
        level1 = tree.children[0]
        assert len(level1) == 3 and len({int(tree.tokens[c]) for c in level1}) == 3
        assert all(torch.equal(tree.draft_probs[c], tree.draft_probs[level1[0]]) for c in level1)
        assert all(len(tree.children[c]) <= 1 for c in range(1, tree.size))  # chains below the first level
    trees.clear()
    generate_speculative(target, proposer, prompt, GenerationConfig(max_new_tokens=24), shape)
    assert trees and all(t.draft_probs is None for t in trees)  # greedy: EAGLE-2's top-k tree, unchanged
