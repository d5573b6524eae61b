"""Adaptive draft depth: the controller's rule, and losslessness while the shape changes."""

import pytest
import torch

from anchorspec.api import attach_drafter
from anchorspec.decode.adaptive import AdaptiveDepth, PIDDepth
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import init_drafter
from helpers import OracleProposer, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rule_moves_depth_within_bounds():
    c = AdaptiveDepth(TreeShape.chain(3), min_depth=1, max_depth=5)
    for _ in range(4):
        c.observe(c.depth, c.depth)  # all accepted
    assert c.depth == 5 and c.shape() == TreeShape.chain(5)
    c.observe(5, 4)  # one wasted level: keep
    assert c.depth == 5
    for _ in range(9):
        c.observe(c.depth, 0)
    assert c.depth == 1
    c.observe(1, 0)  # depth 1, nothing accepted: a < d - 1 is false, stays at the floor
    assert c.depth == 1
    c.depth = 4
    c.observe(2, 0)  # a draft cut short by the token budget says nothing
    assert c.depth == 4 and c.history[-1] == 2


def test_tree_budget_scales_with_depth():
    c = AdaptiveDepth(TreeShape(4, 4, 17))  # 4 nodes per level
    assert c.shape() == TreeShape(4, 4, 17)
    c.depth = 2
    assert c.shape() == TreeShape(4, 2, 9)
    c.depth = 6
    assert c.shape() == TreeShape(4, 6, 25)
    c = AdaptiveDepth(TreeShape(2, 3, 40))  # more nodes than a 2-ary depth-1 tree can hold
    c.depth = 1
    assert c.shape() == TreeShape(2, 1, 3)
    with pytest.raises(AnchorspecError, match="min_depth"):
        AdaptiveDepth(TreeShape.chain(3), min_depth=4)


@pytest.mark.parametrize("controller", [AdaptiveDepth, PIDDepth])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("base", [TreeShape.chain(3), TreeShape(2, 3, 7)])
def test_controller_is_lossless_and_adapts(controller, family, base):
    target = tiny_target(family)
    prompt = torch.tensor([3, 4, 5, 6, 7])
    cfg = GenerationConfig(max_new_tokens=40)
    ref = generate_vanilla(target, prompt, cfg).token_ids

    oracle = controller(base, max_depth=6)
    res = generate_speculative(target, OracleProposer(target), prompt, cfg, oracle)
    assert res.token_ids == ref
    assert max(oracle.history) == 6  # everything accepted: it went as deep as allowed

    drafter = init_drafter(target.config, "eagle3.1", seed=5).to(torch.float64)
    attach_drafter(target, drafter)
    weak = controller(base)
    res = generate_speculative(target, EagleProposer(drafter), prompt, cfg, weak)
    assert res.token_ids == ref
    assert weak.history[-1] < base.depth  # a random drafter: it backed off


def test_pid_moves_with_the_accepted_share_and_stays_in_bounds():
    from anchorspec.decode.adaptive import depth_controller

    c = PIDDepth(TreeShape.chain(3), min_depth=1, max_depth=8)
    for _ in range(6):
        c.observe(c.depth, c.depth)  # everything accepted: above the setpoint, it goes deeper
    assert c.depth == 8 and c.x == 8.0  # clamped: no wind-up past the bound
    first_drop = None
    for _ in range(12):
        before = c.depth
        c.observe(c.depth, 0)  # nothing accepted: it backs off, by more than one level at first
        first_drop = before - c.depth if first_drop is None else first_drop
    assert c.depth == 1 and first_drop >= 2
    steady = PIDDepth(TreeShape.chain(4))
    for _ in range(10):
        steady.observe(steady.depth, steady.depth // 2)  # exactly the setpoint: the depth holds
    assert steady.depth == 4 and {d for d, _, _ in steady.trace} == {4}
    c.depth, c.x = 5, 5.0
    c.observe(2, 0)  # a draft cut short by the token budget says nothing
    assert c.depth == 5 and c.history[-1] == 2
    assert isinstance(depth_controller("pid", TreeShape.chain(2)), PIDDepth)
    assert depth_controller(None, TreeShape.chain(2)) == TreeShape.chain(2)
    with pytest.raises(AnchorspecError, match="depth control"):
        depth_controller("bang-bang", TreeShape.chain(2))
    with pytest.raises(AnchorspecError, match="setpoint"):
        PIDDepth(TreeShape.chain(2), setpoint=1.5)
