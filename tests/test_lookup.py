"""Context lookup (decode/lookup.py): the chain it copies, its merge into a draft tree, and greedy
decoding with it merged into every draft staying the target's own output token for token (float64,
every family, chains and trees, random and oracle drafters, a stop token inside an accepted chain,
the token budget, batched rounds); sampled drafts take its tokens as fixed candidates."""

from __future__ import annotations

import pytest
import torch

from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_speculative, generate_vanilla
from anchorspec.decode.lookup import ContextLookup, LookupSettings, common_prefix, merge_chain
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.drafting import run_program
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import DraftTree, TreeShape
from anchorspec.errors import AnchorspecError
from helpers import FAMILIES, OracleProposer, random_drafter, tiny_target
from lookup_world import BATCH_PROMPTS, BATCH_TOKENS, PROMPTS, SINGLE, in_rounds, stop_inside_a_cycle

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [TreeShape.chain(1), TreeShape.chain(3), TreeShape(2, 3, 6), TreeShape(8, 6, 32)]
LOOKUP = LookupSettings()
BATCH_SHAPES = [TreeShape.chain(3), TreeShape(2, 3, 6), TreeShape.chain(1)]


def lookup_of(tokens, accepted=None, **settings) -> ContextLookup:
    lookup = ContextLookup(LookupSettings(**settings))
    lookup.extend(tokens)
    lookup.observe(accepted)
    return lookup


def test_chain_follows_the_latest_occurrence_of_the_longest_suffix():
    # (2, 3) last occurred before 8, but the longer (1, 2, 3) occurred before 7: the longer match wins
    assert lookup_of([1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], accepted=1).propose(9) == [7, 5, 2, 3]
    # of two occurrences of the same suffix, the latest
    assert lookup_of([4, 9, 1, 4, 9, 2, 0, 4, 9], accepted=1).propose(9)[:1] == [2]
    assert lookup_of([1, 2, 3, 4, 5]).propose(9) == []  # nothing repeats
    assert lookup_of([1, 2]).propose(9) == []  # too short to hold a suffix and an earlier occurrence


def test_chain_copies_with_overlap_and_adapts_its_length():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert lookup_of(tokens, accepted=0).propose(99) == [3, 1]  # 2 * 0 + 2
    assert lookup_of(tokens).propose(99) == [3, 1, 2, 3]  # no chain before: 4
    assert lookup_of(tokens, accepted=3).propose(99) == [3, 1, 2, 3, 1, 2, 3, 1]  # past the end: the loop repeats
    assert len(lookup_of(tokens, accepted=50).propose(99)) == LOOKUP.max_tokens
    assert lookup_of(tokens, accepted=3).propose(3) == [3, 1, 2]  # the room left caps it
    assert lookup_of(tokens, accepted=3).propose(0) == []


def test_index_grows_with_the_sequence():
    lookup = lookup_of([1, 2, 3, 4], accepted=2)
    assert lookup.propose(9) == []
    lookup.extend([9, 2, 3])  # (2, 3) occurred before 4
    assert lookup.propose(9)[:1] == [4]
    lookup.extend([4, 7, 7])
    assert lookup.propose(9)[:1] == []  # (4, 7, 7), (7, 7): no earlier occurrence
    lookup.extend([2, 3])  # (2, 3): now latest before 4 again (index 7), (3, 4, 7)... the latest wins
    assert lookup.propose(9)[:2] == [4, 7]


def test_settings_are_checked():
    for bad in (dict(max_tokens=0), dict(min_match=0), dict(min_match=5, max_match=4)):
        with pytest.raises(AnchorspecError):
            LookupSettings(**bad)


def test_merge_shares_the_prefix_and_appends_the_rest():
    tree = DraftTree(torch.tensor([10, 11, 12, 13]), [-1, 0, 0, 1])  # root 10; 11 -> 13; 12
    merged = merge_chain(tree, [11, 13, 14, 15])
    assert merged.tokens.tolist() == [10, 11, 12, 13, 14, 15] and merged.parents == [-1, 0, 0, 1, 3, 4]
    assert merged.children[0][0] == 1  # the drafter's first child stays first
    merged = merge_chain(tree, [12, 11])  # leaves the tree at 12: 11 becomes 12's child
    assert merged.tokens.tolist()[4:] == [11] and merged.parents[4] == 2
    merged = merge_chain(tree, [9, 8])  # nothing shared: a new branch under the root, after the drafter's
    assert merged.parents[4:] == [0, 4] and merged.children[0] == [1, 2, 4]
    assert merge_chain(tree, [11, 13]) is tree  # all shared


def test_merged_into_a_sampled_draft_the_copied_tokens_are_fixed():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    sampled = DraftTree(torch.tensor([1, 2, 3]), [-1, 0, 1], draft_probs=torch.stack([torch.zeros(5), q, q * 2]))
    merged = merge_chain(sampled, [2, 4, 0])  # shares the drawn 2, then leaves the draft at 4
    assert merged.tokens.tolist() == [1, 2, 3, 4, 0] and merged.parents == [-1, 0, 1, 1, 3]
    assert merged.fixed == {3, 4} and torch.equal(merged.draft_probs[:3], sampled.draft_probs)
    assert not merged.draft_probs[3:].any()  # drawn from no q
    assert merge_chain(sampled, [2, 3]) is sampled
    # the levels of a staged walk, or a held subtree, keep which nodes are fixed
    assert merged.levels(1)[0].fixed == frozenset() and merged.subtree(1).fixed == {2, 3}
    with pytest.raises(AnchorspecError, match="fixed"):
        DraftTree(torch.tensor([1, 2]), [-1, 0], fixed=frozenset({1}))  # a greedy draft has no drawn nodes


def test_common_prefix_counts_the_chains_tokens_the_step_emitted():
    assert common_prefix([4, 5, 6], [4, 5, 9]) == 2
    assert common_prefix([4, 5], [4, 5, 6, 7]) == 2
    assert common_prefix([4, 5], [7]) == 0
    assert common_prefix([], [1]) == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_lookup_is_the_targets_output_every_family(family):
    target = tiny_target(family)
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=40)
    won = rows = 0
    for prompt in PROMPTS:
        ref = generate_vanilla(target, prompt, cfg).token_ids
        for shape in SHAPES:
            res = generate_speculative(target, proposer, prompt, cfg, shape, lookup=LOOKUP)
            assert res.token_ids == ref, (family, shape)
            won, rows = won + res.stats.lookup_tokens, rows + res.stats.lookup_rows
    assert rows >= won > 0  # the chains were accepted: the tiny targets cycle


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 4, 12)], ids=str)
def test_lookup_beside_an_oracle_drafter(shape):
    """An oracle's drafts are all accepted; a chain merged beside them must not change the output."""
    target = tiny_target("llama")
    cfg = GenerationConfig(max_new_tokens=40)
    for prompt in PROMPTS:
        ref = generate_vanilla(target, prompt, cfg).token_ids
        res = generate_speculative(target, OracleProposer(target), prompt, cfg, shape, lookup=LOOKUP)
        assert res.token_ids == ref
        assert res.stats.tau >= shape.depth  # the oracle's depth per step at least (the budget's last step aside)


def test_lookup_raises_tau_where_the_output_cycles():
    target = tiny_target("qwen2")  # its greedy output is a 2-token cycle from the first token
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=48)
    without = generate_speculative(target, proposer, PROMPTS[0], cfg, TreeShape.chain(3))
    with_lookup = generate_speculative(target, proposer, PROMPTS[0], cfg, TreeShape.chain(3), lookup=LOOKUP)
    assert with_lookup.token_ids == without.token_ids
    assert with_lookup.stats.tau > 2 * without.stats.tau
    assert with_lookup.stats.target_forwards < without.stats.target_forwards / 2


def test_stop_token_inside_an_accepted_lookup_chain():
    target, prompt, cfg, ref = stop_inside_a_cycle()
    res = generate_speculative(target, EagleProposer(random_drafter(target)), prompt, cfg, TreeShape.chain(1),
                               lookup=LOOKUP)
    assert res.token_ids == ref.token_ids and res.finish_reason == "stop"
    assert res.stats.lookup_tokens >= 4  # the stop came from inside an accepted chain, with more accepted after it


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9, 17])
def test_lookup_keeps_the_token_budget(max_new):
    target = tiny_target("qwen2")
    cfg = GenerationConfig(max_new_tokens=max_new)
    ref = generate_vanilla(target, PROMPTS[0], cfg)
    for shape in (TreeShape.chain(2), TreeShape(3, 4, 12)):
        res = generate_speculative(target, EagleProposer(random_drafter(target)), PROMPTS[0], cfg, shape,
                                   lookup=LookupSettings(max_tokens=32))
        assert res.token_ids == ref.token_ids and res.finish_reason == "length"


def test_reports_keep_the_drafters_own_depth_and_acceptance():
    """What the monitor learns the drafter's acceptance from must not count the chain's tokens."""
    target = tiny_target("qwen2")
    shape = TreeShape.chain(2)
    dec = SpeculativeDecoding(target, EagleProposer(random_drafter(target)), PROMPTS[0],
                              GenerationConfig(max_new_tokens=40), shape, lookup=LOOKUP)
    dec.step()  # the prefill
    extended = []
    while not dec.finished:
        report = dec.step()
        assert report.drafter_depth <= shape.depth and report.drafter_accepted <= report.accepted
        if report.lookup_rows:
            extended.append(report)
    assert any(r.depth > shape.depth and r.accepted > r.drafter_accepted for r in extended)


def test_batched_rounds_with_lookup_match_solo():
    target = tiny_target("llama")
    drafter = random_drafter(target)
    cfgs = [GenerationConfig(max_new_tokens=n) for n in BATCH_TOKENS]
    refs = [generate_vanilla(target, p, c).token_ids for p, c in zip(BATCH_PROMPTS, cfgs)]
    decs = batched(target, drafter, cfgs, LOOKUP)
    assert [d.result().token_ids for d in decs] == refs
    won = sum(d.result().stats.lookup_tokens for d in decs)
    assert sum(d.result().stats.lookup_rows for d in decs) > won > 0  # chains accepted, and cut where a cycle breaks


def batched(target, drafter, cfgs, lookup) -> list[SpeculativeDecoding]:
    """BATCH_PROMPTS decoded in rounds of one BatchDecoder, each with its BATCH_SHAPES shape and `cfgs` config."""
    decs = [SpeculativeDecoding(target, EagleProposer(drafter), p, c, s, lookup=lookup)
            for p, c, s in zip(BATCH_PROMPTS, cfgs, BATCH_SHAPES)]
    return in_rounds(target, decs)


def test_sampled_batched_rounds_with_lookup_match_solo():
    """Seeded sampling with copied chains: rounds of three give each sequence its solo tokens and chains."""
    target = tiny_target("llama")
    drafter = random_drafter(target)
    cfgs = [GenerationConfig(max_new_tokens=n, sampling=SamplingParams(1.0, 0.95), seed=7 + n) for n in BATCH_TOKENS]
    solo = [generate_speculative(target, EagleProposer(drafter), p, c, s, lookup=SINGLE)
            for p, c, s in zip(BATCH_PROMPTS, cfgs, BATCH_SHAPES)]
    decs = batched(target, drafter, cfgs, SINGLE)
    assert [d.result().token_ids for d in decs] == [r.token_ids for r in solo]
    assert [d.result().stats.lookup_rows for d in decs] == [r.stats.lookup_rows for r in solo]
    assert sum(r.stats.lookup_rows for r in solo) > 0


def test_sampled_decoding_verifies_the_copied_chain():
    """At T > 0 the chain's tokens are verified beside the drafter's (their distribution: test_sampling_e2e.py)."""
    target = tiny_target("qwen2")
    drafter = random_drafter(target)
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0), seed=3)
    looked = generate_speculative(target, EagleProposer(drafter), PROMPTS[0], cfg, TreeShape.chain(3), lookup=SINGLE)
    assert looked.stats.lookup_rows > 0
    again = generate_speculative(target, EagleProposer(drafter), PROMPTS[0], cfg, TreeShape.chain(3), lookup=SINGLE)
    assert again.token_ids == looked.token_ids  # seeded: the same draws and coins


def test_lookup_and_staged_verification_are_refused_together():
    target = tiny_target("llama")
    with pytest.raises(AnchorspecError, match="staged"):
        SpeculativeDecoding(target, EagleProposer(random_drafter(target)), PROMPTS[0], GenerationConfig(),
                            TreeShape(2, 3, 6), staged=1, lookup=LOOKUP)


def test_replay_benchmark_walks_as_the_engine_decodes():
    """benchmarks/lookup_replay.py's walk: without a lookup it is decode.shape.replay; with one, the
    engine's own tau on the same answer (the walk replays what `generate` does, step for step)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from lookup_replay import walk

    from anchorspec.decode.shape import captured_states, replay

    target = tiny_target("granite")
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=40)
    answer = generate_vanilla(target, PROMPTS[0], cfg).token_ids
    sequence = torch.cat([PROMPTS[0], torch.tensor(answer)])
    aux = captured_states(target, sequence)
    shape = TreeShape(2, 3, 6)
    emitted, steps, _, won = walk(proposer, sequence, len(PROMPTS[0]), aux, shape, None)
    assert won == 0
    assert emitted / steps == pytest.approx(replay(target, proposer, sequence, len(PROMPTS[0]), shape, aux=aux).tau)
    emitted, steps, rows, _ = walk(proposer, sequence, len(PROMPTS[0]), aux, shape, LOOKUP)
    real = generate_speculative(target, proposer, PROMPTS[0], cfg, shape, lookup=LOOKUP).stats
    assert (emitted, steps) == (real.accepted_tokens + real.verify_steps, real.verify_steps)
    assert rows == real.drafted_tokens + real.verify_steps  # the root's row too


@pytest.mark.parametrize("rule", ["step", "pid"])
def test_adaptive_depth_with_lookup_stays_lossless_and_learns_from_the_drafter(rule):
    from anchorspec.decode.adaptive import depth_controller

    target = tiny_target("qwen2")  # a 2-token cycle: the lookup chain accepts deep, the random drafter nothing
    cfg = GenerationConfig(max_new_tokens=40)
    ref = generate_vanilla(target, PROMPTS[0], cfg).token_ids
    controller = depth_controller(rule, TreeShape.chain(4))
    res = generate_speculative(target, EagleProposer(random_drafter(target)), PROMPTS[0], cfg, controller,
                               lookup=LOOKUP)
    assert res.token_ids == ref and res.stats.lookup_tokens > 0
    assert controller.shape().depth < 4  # it backed off: the chain's acceptance is not the drafter's


def test_a_step_drafted_without_its_lookup_merges_no_chain_and_keeps_the_chain_length():
    """draft(lookup=False), as a batched round that one row's chain would widen for every row drafts: no chain rows,
    the lookup's adaptive length left as it was (not reset as after a step that found no chain), output the
    target's."""
    target = tiny_target("qwen2")
    cfg = GenerationConfig(max_new_tokens=40)
    dec = SpeculativeDecoding(target, EagleProposer(random_drafter(target)), PROMPTS[0], cfg, TreeShape.chain(2),
                              lookup=LOOKUP)
    dec.step()  # the prefill
    while not dec.finished:
        dec.lookup.limit = 7
        tree = run_program(dec.draft(True, None, lookup=False))
        logits, aux = dec._forward(tree, capture_aux=True)
        report = dec.finish(logits, aux, 0.0)
        assert report.lookup_rows == 0 and dec.lookup.limit == 7
    assert dec.result().token_ids == generate_vanilla(target, PROMPTS[0], cfg).token_ids
