"""Tree attention and KV bookkeeping, checked against the plain causal computation.

- Every node of a verified tree gets the logits (and aux features) it would get on its own branch.
- After committing an accepted path, the target KV slot equals a fresh prefill of the committed tokens.
- The drafter cache holds only real-feature positions: drafting leaves it unchanged, and feeding the
  accepted features step by step equals feeding them all at once.
"""

import pytest
import torch

from anchorspec.api import attach_drafter
from anchorspec.decode.batch import BatchKV, batch_forward
from anchorspec.decode.drafting import run_program
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import DraftTree, TreeShape, tree_attention_mask, tree_position_ids
from anchorspec.models.drafter import init_drafter
from helpers import VOCAB, tiny_target

# root; two children; grandchildren under both; one depth-3 node under node 3
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def make_tree(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return DraftTree(torch.randint(0, VOCAB, (len(PARENTS),), generator=gen), list(PARENTS))


def prefill(target, context):
    cache = target.new_cache()
    target.forward(context, torch.arange(context.numel()), cache)
    return cache


def verify_forward(target, context, tree):
    cache = prefill(target, context)
    n = context.numel()
    out = target.forward(tree.tokens, tree_position_ids(tree, n), cache,
                         attention_mask=tree_attention_mask(tree, n, target.dtype), capture_aux=True)
    return cache, out


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_tree_mask_equals_branch_attention(family):
    target = tiny_target(family)
    context = torch.arange(3, 15)
    tree = make_tree()
    _, out = verify_forward(target, context, tree)
    for node in range(tree.size):
        branch = torch.cat([context, tree.tokens[tree.path_to(node)]])
        ref = target.forward(branch, torch.arange(branch.numel()), target.new_cache(), capture_aux=True)
        torch.testing.assert_close(out.logits[node], ref.logits[-1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.aux[node], ref.aux[-1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", [[0], [0, 1], [0, 2, 5, 7], [0, 1, 3, 6], list(range(4))], ids=str)
def test_commit_equals_fresh_prefill(path):
    """A tree verified in a KV slot, then its path committed: the slot's rows equal a fresh prefill
    of the committed tokens, and decoding continues exactly as from it."""
    target = tiny_target("llama")
    context = torch.arange(3, 15)
    tree = make_tree()
    if path == list(range(4)):  # a chain: its path is already in place
        tree = DraftTree(tree.tokens[:4], [-1, 0, 1, 2])
    kv = BatchKV(slots=1, capacity=8)  # small: the verification grows it
    slot = kv.attach_target(target)
    batch_forward(target, [slot], [DraftTree.chain(context)], capture_aux=False)
    slot.commit(0, list(range(context.numel())))
    batch_forward(target, [slot], [tree])
    slot.commit(context.numel(), path)
    fresh = prefill(target, torch.cat([context, tree.tokens[path]]))
    assert slot.length == context.numel() + len(path)
    for keys, values, want in zip(kv.keys, kv.values, fresh.layers):
        torch.testing.assert_close(keys[:1, :, :slot.length], want.keys, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(values[:1, :, :slot.length], want.values, rtol=1e-10, atol=1e-10)
    # and decoding continues exactly as from the fresh cache
    nxt = torch.tensor([7])
    pos = torch.tensor([context.numel() + len(path)])
    torch.testing.assert_close(batch_forward(target, [slot], [DraftTree(nxt, [-1])]).logits[0],
                               target.forward(nxt, pos, fresh).logits)


def _proposer(target):
    drafter = init_drafter(target.config, "eagle3.1", draft_vocab_size=64, seed=3).to(torch.float64)
    attach_drafter(target, drafter)
    return EagleProposer(drafter)


def _primed_proposer():
    """A proposer that has seen a 12-token context plus the pending token 9."""
    target = tiny_target("llama")
    proposer = _proposer(target)
    ids = torch.arange(3, 15)
    aux = target.forward(ids, torch.arange(12), target.new_cache(), capture_aux=True).aux
    proposer.update(torch.cat([ids, torch.tensor([9])]), aux)
    return proposer


def test_drafting_leaves_drafter_cache_untouched():
    proposer = _primed_proposer()
    k, v = (rows[0].clone() for rows in proposer.cache_rows())
    for shape in (TreeShape.chain(4), TreeShape(4, 4, 16)):
        proposer.propose(shape, SamplingParams(), None)
        (k_after,), (v_after,) = proposer.cache_rows()
        assert torch.equal(k_after, k) and torch.equal(v_after, v)


def test_incremental_drafter_updates_equal_one_pass():
    target = tiny_target("llama")
    tokens = torch.arange(3, 23)
    aux = target.forward(tokens[:-1], torch.arange(19), target.new_cache(), capture_aux=True).aux
    whole, steps = _proposer(target), _proposer(target)
    whole.update(tokens, aux)
    for end in (10, 11, 15, 19):  # prefill, then accepted chunks of 1, 4 and 4 positions
        start = steps.cache.length
        steps.update(tokens[: end + 1], aux[start:end])
    for a, b in zip(steps.cache_rows(), whole.cache_rows()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(steps.logits, whole.logits)


def test_tree_drafting_matches_chain_drafting_on_the_top_branch():
    """With top_k=1 the dynamic tree must reproduce greedy chain drafting exactly (same masks, positions)."""
    proposer = _primed_proposer()
    chain = proposer.propose(TreeShape.chain(5), SamplingParams(), None)
    tree = run_program(proposer._tree(TreeShape(1, 5, 6), SamplingParams(), None))  # the tree path, forced
    assert tree.tokens.tolist() == chain.tokens.tolist()
    assert tree.parents == chain.parents
