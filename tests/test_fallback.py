"""The single-stream fallback (decode/fallback.py): plain steps while speculation does not pay.

Lossless while switching (float64, greedy and seeded sampling, random and oracle drafters, a stop
token inside a draft, the token limit); the monitor switches off when the measured costs say a
draft cannot pay and retries later, stays on when it pays; the starting shape follows the cost
curve; and a broken plain step inside the speculative loop is caught (negative control).
"""

import json

import math
import statistics

import pytest
import torch

import anchorspec.decode.engine as engine_module
import anchorspec.decode.fallback as fallback_module
from anchorspec.api import Engine
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_speculative, generate_vanilla
from anchorspec.decode.fallback import (COST_WINDOW, EXPLORE_EVERY, EXPLORE_FLOOR, PACE_WINDOW, PRIOR_STEPS,
                                        PRIOR_TREE_RATIO, TREE_CANDIDATES, TREE_PRIOR_WEIGHT, DriftMonitor,
                                        StreamMonitor)
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import DraftTree, TreeShape
from helpers import OracleProposer, prompts, random_drafter, tiny_target
from sampling_world import NEW, PARAMS, PROMPT, exact_distribution, worst_p_value
from sampling_world import setup  # noqa: F401 (a fixture)

SHAPES = [TreeShape.chain(3), TreeShape(3, 3, 8)]


class FrozenCosts(StreamMonitor):
    """A monitor whose costs are given, not timed: decisions depend on acceptance only, so a test
    is deterministic. Records the kind of every step it sees, and learns acceptance from them."""

    def __init__(self, plain=1.0, verify_per_token=0.0, draft_per_level=0.0, **kwargs):
        super().__init__(**kwargs)
        for n in (1, 2, 4, 8, 16, 32):
            self.verify.add(n, plain + verify_per_token * (n - 1))
        for d in (1, 2, 4, 8):
            self.draft.add(d, draft_per_level * d)
        self.calibrated = True
        self.kinds: list[str] = []

    def observe_step(self, kind, tokens, depth, accepted, step_s, draft_s, catch_up=False, top_ranked=None,
                     top_depth=None, shape=None, lookup_accepted=0):
        self.kinds.append(kind)
        shape = shape if shape is not None else self.shape
        if kind == "speculative":
            self.learn_acceptance(None if shape is None or shape.is_chain else shape, depth, accepted, top_ranked,
                                  top_depth)


def price_tree(m: StreamMonitor, seconds: float, shape: TreeShape = TreeShape(4, 4, 16), provisional: bool = False):
    """Give `m` a drafting time for tree `shape` (`provisional`: as the calibration's)."""
    m.tree_draft_curve(shape).add(shape.depth, seconds, provisional=provisional)


def switching(**kwargs):
    """Switches as often as possible: off after one step below tau* (judged alone, not shrunk toward the
    long-run tau), a retry every other step."""
    m = FrozenCosts(window=1, min_steps=1, retry_after=1, max_retry_after=1, **kwargs)  # no probe backoff
    m.prior_steps = 0
    return m


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_greedy_lossless_while_switching(shape, drafter):
    target = tiny_target("llama")
    proposer = OracleProposer(target) if drafter == "oracle" else EagleProposer(random_drafter(target))
    # the oracle's tau is depth + 1: only an unreachable break-even makes it switch
    tau_star = 100.0 if drafter == "oracle" else 1.5
    cfg = GenerationConfig(max_new_tokens=30)
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        monitor = switching(threshold=tau_star)
        res = generate_speculative(target, proposer, prompt, cfg, shape, fallback=monitor)
        assert res.token_ids == ref
        assert res.stats.fallback_switches >= 4  # several off/on switches in one generation
        assert {"speculative", "plain"} <= set(monitor.kinds)


@pytest.mark.parametrize("family", ["llama", "granite"])
def test_greedy_lossless_while_switching_with_a_lookup_chain(family):
    """A context-lookup chain merged into the drafts (decode/lookup.py) while steps switch between plain and
    speculative: a switched-off step still verifies a copied chain where one is found (kind "lookup", no
    drafter pass), and the chain's length carries across the switches."""
    from anchorspec.decode.lookup import LookupSettings

    target = tiny_target(family)
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=40)
    won = alone = 0
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        monitor = switching(threshold=1.5)
        res = generate_speculative(target, proposer, prompt, cfg, TreeShape.chain(3), fallback=monitor,
                                   lookup=LookupSettings())
        assert res.token_ids == ref
        assert res.stats.fallback_switches >= 2 and {"speculative", "plain"} <= set(monitor.kinds)
        won += res.stats.lookup_tokens
        alone += monitor.kinds.count("lookup")
    assert won > 0 and alone > 0


class Alternating:
    """A chain-alone rule that says yes to every other step that found a chain: both kinds of step, back to back."""

    def __init__(self):
        self.calls = 0

    def __call__(self, found: int) -> bool:
        self.calls += 1
        return self.calls % 2 == 0


@pytest.mark.parametrize("family", ["llama", "granite"])
@pytest.mark.parametrize("drafter", ["random", "oracle"])
@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(2, 3, 6)], ids=str)
def test_greedy_lossless_while_chains_are_verified_alone_between_drafted_steps(family, drafter, shape):
    """A speculating stream whose steps verify the copied chain alone (no drafter pass, kind "lookup": ChainChoice)
    between steps that draft: token for token the target's output. The EAGLE drafter then catches up on the
    features of the chain-alone steps (its update refuses a feature count that does not match the sequence), and
    an oracle's drafts after them are still accepted."""
    from anchorspec.decode.lookup import LookupSettings

    target = tiny_target(family)
    proposer = OracleProposer(target) if drafter == "oracle" else EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=40)
    kinds = []
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        monitor = FrozenCosts(threshold=1.0)  # never switches off: the steps that skip the drafter are the rule's
        monitor.chain_alone = Alternating()
        dec = SpeculativeDecoding(target, proposer, prompt, cfg, shape, lookup=LookupSettings())
        res = dec.run(monitor)
        assert res.token_ids == ref and res.stats.fallback_switches == 0
        kinds += monitor.kinds
        if drafter == "oracle":  # drafted steps after chain-alone ones: the drafter's own path still accepted whole
            assert res.stats.tau >= 2
    assert kinds.count("lookup") >= 2 and kinds.count("speculative") >= 4


def test_stop_token_and_budget_inside_a_chain_verified_alone():
    """A stop token inside a chain the stream verifies alone ends the output there; the token budget caps the
    chain as it caps a drafted one."""
    from anchorspec.decode.lookup import LookupSettings
    from lookup_world import PROMPTS, stop_inside_a_cycle

    target, prompt, cfg, ref = stop_inside_a_cycle()
    monitor = FrozenCosts(threshold=1.0)
    monitor.chain_alone = lambda found: True
    res = SpeculativeDecoding(target, EagleProposer(random_drafter(target)), prompt, cfg, TreeShape.chain(1),
                              lookup=LookupSettings()).run(monitor)
    assert res.token_ids == ref.token_ids and res.finish_reason == "stop" and "lookup" in monitor.kinds
    target = tiny_target("qwen2")
    for max_new in (1, 2, 3, 5, 9, 17):
        cfg = GenerationConfig(max_new_tokens=max_new)
        monitor = FrozenCosts(threshold=1.0)
        monitor.chain_alone = lambda found: True
        res = SpeculativeDecoding(target, EagleProposer(random_drafter(target)), PROMPTS[0], cfg, TreeShape.chain(2),
                                  lookup=LookupSettings(max_tokens=32)).run(monitor)
        assert res.token_ids == generate_vanilla(target, PROMPTS[0], cfg).token_ids and res.finish_reason == "length"


def chain_priced(**costs) -> StreamMonitor:
    """A greedy stream's monitor drafting chain 3 on given costs, its drafter accepting half its tokens per level."""
    m = FrozenCosts(**costs)
    m.shape = TreeShape.chain(3)
    m.reached, m.accepted = [1000] * 3, [500] * 3
    return m


def teach_chains(m: StreamMonitor, found: int, steps: int, chain_accepted: int, accepted: int, rows: int,
                 kind: str = "speculative") -> None:
    for _ in range(steps):
        m.learn_chain(kind, found, chain_accepted, accepted, rows)


def test_a_chain_is_verified_alone_where_it_wins_what_the_drafters_tree_would_for_less():
    """ChainChoice's price: a chain found 8 long that is accepted whole, and beside which the drafter's tree won
    nothing, is verified alone (no drafting, 9 rows instead of 4 + 8); one that is never accepted, beside which
    the tree won its tokens, is merged."""
    m = chain_priced(plain=1.0, verify_per_token=0.05, draft_per_level=0.1)
    teach_chains(m, 8, 20, chain_accepted=8, accepted=8, rows=8)  # the chain won all; the tree nothing more
    teach_chains(m, 2, 20, chain_accepted=0, accepted=2, rows=2)  # a miss: the drafter's tree won two tokens
    assert m.chain_choice.drafter_gain(8, 1.0)[0] < 0.2 and m.chain_choice.chain_tokens(8) > 6
    assert m.chain_alone(8) and not m.chain_alone(2)
    assert not m.chain_alone(5)  # a length never seen: the priors (half a token a position; the drafter's whole gain)
    m.regime = "sampled"
    assert not m.chain_alone(8)  # sampled decoding merges: a chain alone wins little there
    m.regime = "greedy"
    m.enabled = False
    assert not m.chain_alone(8)  # speculation forced: every step drafts
    m.enabled = True
    m.chain_choice = None
    assert not m.chain_alone(8)  # the rule before session 78


def test_a_length_verified_alone_is_merged_again_once_its_drafters_gain_has_faded():
    """A length chosen alone keeps no merged steps to learn the drafter's gain from, so that gain fades back to its
    prior (the drafter's expected tokens) and the stream drafts beside the chain again: a length is never left
    alone for good on old evidence."""
    from anchorspec.decode.lookup import CHAIN_MEMORY

    m = chain_priced(plain=1.0, verify_per_token=0.05, draft_per_level=0.1)
    m.accepted = [900] * 3  # a drafter accepting 9 tokens in 10 a level: 2.4 tokens a step expected
    teach_chains(m, 6, 20, chain_accepted=3, accepted=3, rows=6)  # half the chain won, the tree nothing more
    assert m.chain_alone(6)
    teach_chains(m, 6, 3 * CHAIN_MEMORY, chain_accepted=3, accepted=3, rows=0, kind="lookup")  # verified alone
    assert m.chain_choice.drafter_gain(6, 2.4)[0] > 1.8 and not m.chain_alone(6)
    teach_chains(m, 6, 20, chain_accepted=3, accepted=3, rows=6)  # merged again: the gain is measured afresh
    assert m.chain_alone(6)


def test_a_stream_verifies_its_copied_chains_alone_where_the_drafter_adds_nothing():
    """End to end on a target whose greedy output cycles (the copied chain accepts whole) with a random drafter
    (its tree adds nothing): once measured, chains are verified alone, the drafter still speculating, and the
    output is the target's; with the choice off every step drafts."""
    from anchorspec.decode.lookup import LookupSettings
    from lookup_world import PROMPTS

    target = tiny_target("qwen2")
    cfg = GenerationConfig(max_new_tokens=160)  # each found length is learned apart: a few of each
    ref = generate_vanilla(target, PROMPTS[0], cfg).token_ids
    kinds = {}
    for choice in ("on", "off"):
        m = chain_priced(plain=1.0, verify_per_token=0.05, draft_per_level=0.1, threshold=1.0)
        if choice == "off":
            m.chain_choice = None
        res = SpeculativeDecoding(target, EagleProposer(random_drafter(target)), PROMPTS[0], cfg, TreeShape.chain(3),
                                  lookup=LookupSettings()).run(m)
        assert res.token_ids == ref
        kinds[choice] = m.kinds
    later = kinds["on"][len(kinds["on"]) // 2:]  # once the lengths the chain grows to were measured
    assert later.count("lookup") > 0.5 * len(later) and "lookup" not in kinds["off"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stop_token_inside_a_draft_while_switching(shape):
    target = tiny_target("llama")
    prompt = prompts()[0]
    free = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    for at in (3, 6, 11):  # the stop token lands in different steps, speculative or plain
        stop = free[at]
        cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,))
        ref = generate_vanilla(target, prompt, cfg)
        for proposer in (OracleProposer(target), EagleProposer(random_drafter(target))):
            res = generate_speculative(target, proposer, prompt, cfg, shape, fallback=switching(threshold=100.0))
            assert res.token_ids == ref.token_ids and res.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9, 14])
def test_token_limit_while_switching(max_new):
    target = tiny_target("llama")
    prompt = prompts()[0]
    cfg = GenerationConfig(max_new_tokens=max_new)
    ref = generate_vanilla(target, prompt, cfg).token_ids
    for shape in SHAPES:
        res = generate_speculative(target, OracleProposer(target), prompt, cfg, shape,
                                   fallback=switching(threshold=100.0))
        assert res.token_ids == ref and res.finish_reason == "length"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_seeded_sampling_with_fixed_break_even_is_reproducible(shape):
    """With given costs the switches depend on the random draws only, so a seed fixes the output."""
    target = tiny_target("llama", peaked=1.0)
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0, top_p=0.95), seed=3)
    runs = [generate_speculative(target, proposer, prompts()[0], cfg, shape, fallback=switching(threshold=1.5))
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.fallback_switches >= 2


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=["chain", "tree"])
def test_sampling_while_switching_matches_target_distribution(setup, shape):  # noqa: F811
    """Every step, plain or speculative, draws from the target given its prefix; which kind a step
    is depends only on earlier steps, so the joint distribution of the output is the target's."""
    target, proposer = setup
    monitor = switching(threshold=1.5)
    n = 1200
    samples = torch.zeros(n, NEW, dtype=torch.long)
    switches = 0
    for i in range(n):
        cfg = GenerationConfig(max_new_tokens=NEW, sampling=PARAMS, seed=20_000 + i)
        res = generate_speculative(target, proposer, PROMPT, cfg, shape, fallback=monitor)
        samples[i] = torch.tensor(res.token_ids)
        switches += res.stats.fallback_switches
    assert monitor.kinds.count("plain") > n // 4 and monitor.kinds.count("speculative") > n // 4
    assert switches > n // 2
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


def test_switches_off_when_costs_say_drafting_cannot_pay_and_retries():
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target))
    # a depth-3 chain needs tau > 1.6 to break even: more than a random drafter reaches, less than
    # the prior expects (so the generation starts speculating)
    monitor = FrozenCosts(plain=1.0, verify_per_token=0.15, draft_per_level=0.05, window=4, min_steps=2,
                          retry_after=5)
    monitor.shape = TreeShape.chain(3)
    assert monitor.threshold == pytest.approx(1.6)
    res = generate_speculative(target, proposer, prompts()[0], GenerationConfig(max_new_tokens=60),
                               TreeShape.chain(3), fallback=monitor)
    kinds = monitor.kinds
    first_plain = kinds.index("plain")
    assert kinds[:first_plain] == ["speculative"] * 2  # off as soon as the window holds min_steps
    assert "speculative" in kinds[first_plain:]  # ... and retried later
    assert monitor.switches_off >= 2 and monitor.switches_on >= 1
    assert kinds.count("plain") > kinds.count("speculative")
    assert res.stats.fallback_switches == monitor.switches_off + monitor.switches_on


def test_stays_on_when_speculation_pays():
    """Negative control for the switch: cheap drafts and flat verification, accepted drafts."""
    target = tiny_target("llama")
    monitor = FrozenCosts(plain=1.0, verify_per_token=0.01, draft_per_level=0.01, window=4, min_steps=2,
                          retry_after=5)
    res = generate_speculative(target, OracleProposer(target), prompts()[0], GenerationConfig(max_new_tokens=40),
                               TreeShape.chain(3), fallback=monitor)
    assert res.stats.fallback_switches == 0
    assert monitor.kinds.count("plain") <= 1  # at most one at the very end, where no room is left to draft


def test_new_generation_starts_plain_while_recent_steps_do_not_pay():
    """While the global window says speculation does not pay, a new generation starts plain and is due for
    a retry at once: it probes at the next retry round. (Due only after retry_after plain tokens, as
    before session 31, a generation shorter than that never probed, and nothing refreshed the window.)"""
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target))
    monitor = FrozenCosts(plain=1.0, verify_per_token=0.15, draft_per_level=0.05, window=4, min_steps=2,
                          retry_after=50, global_min_steps=2, max_retry_after=50)  # the probe is not skipped
    cfg = GenerationConfig(max_new_tokens=30)
    generate_speculative(target, proposer, prompts()[0], cfg, TreeShape.chain(3), fallback=monitor)
    assert monitor.kinds[:2] == ["speculative"] * 2 and monitor.global_tau < monitor.threshold
    assert not monitor.global_speculating
    monitor.kinds.clear()
    start = monitor.rounds
    assert start < 50 < start + 39  # the next retry round falls inside the second generation
    cfg = GenerationConfig(max_new_tokens=40)  # shorter than retry_after plain tokens
    second = generate_speculative(target, proposer, prompts()[1], cfg, TreeShape.chain(3), fallback=monitor)
    kinds = monitor.kinds
    probe = kinds.index("speculative")  # it probed ...
    assert probe >= 10 and set(kinds[:probe]) == {"plain"}  # ... after starting plain, at the retry round
    assert kinds[probe:probe + 2] == ["speculative"] * 2 and "plain" in kinds[probe + 2:]  # min_steps, then off
    assert second.token_ids == generate_vanilla(target, prompts()[1], cfg).token_ids


def test_one_slow_start_does_not_close_the_gate_for_every_request():
    """The global gate judges from global_min_steps steps, not from one request's first min_steps: a
    prompt whose first drafts are all rejected turns itself off, not the next requests."""
    m = DriftMonitor(threshold=1.5)  # defaults: min_steps 4, global_min_steps 32
    first = m.new_request()
    for _ in range(m.min_steps):
        m.record(first, "speculative", accepted=0)
    assert not first.speculating  # its own window: off
    assert m.global_speculating and m.new_request().speculating  # 4 steps say nothing about the traffic
    while len(m.recent) < m.global_min_steps:
        m.record(m.new_request(), "speculative", accepted=0)
    assert not m.global_speculating  # 32 rejected steps do
    late = m.new_request()
    assert not late.speculating and late.plain_left == 0  # plain, and probing at the next retry round


def test_break_even_and_shape_follow_the_cost_curve():
    flat = FrozenCosts(plain=1.0, verify_per_token=0.01, draft_per_level=0.02)
    steep = FrozenCosts(plain=1.0, verify_per_token=0.7, draft_per_level=0.02)
    for m in (flat, steep):  # a drafter that is right 90 % of the time at every depth
        m.reached, m.accepted = [1000] * 8, [900] * 8
    deep, deep_speedup = flat.choose_shape()
    shallow, shallow_speedup = steep.choose_shape()
    assert deep.is_chain and shallow.is_chain
    assert deep.depth >= 6 and shallow.depth <= 2 and deep_speedup > shallow_speedup > 1
    flat.shape = TreeShape.chain(4)
    assert flat.threshold == pytest.approx((0.08 + 1.04) / 1.0)
    # with a costly drafter no chain pays, and a generation starts plain
    costly = FrozenCosts(plain=1.0, verify_per_token=0.3, draft_per_level=1.0)
    shape, speedup = costly.choose_shape()
    assert speedup < 1
    assert not costly.start(shape).speculating
    assert flat.start(deep).speculating


def test_a_verify_measured_cheaper_than_a_plain_step_still_prices_at_one():
    """On an AMX CPU one token and two cost the same GEMM time, and a noisy verify(2) can come out below
    verify(1): tau* then fell under 1 and a drafter that never has a token accepted (tau 1.00) kept
    speculating. A verify is priced at no less than the plain step it contains, so it switches off."""
    noisy = FrozenCosts(plain=1.0, verify_per_token=-0.08, draft_per_level=0.03, window=4, min_steps=4)
    assert noisy.verify(2) < noisy.verify(1)  # what the clock said
    noisy.shape = TreeShape.chain(1)
    assert noisy.threshold == pytest.approx(1.03)  # (draft 0.03 + verify at least 1.0) / 1.0: above tau 1.00
    assert noisy.speedup(TreeShape.chain(1)) == pytest.approx(1.5 / 1.03)  # the prior tau 1.5 over the floored cost
    state = noisy.start(TreeShape.chain(1))
    assert state.speculating
    for steps in range(1, 101):  # the window is judged shrunk toward the long-run tau, which each miss lowers
        noisy.observe_step("speculative", 2, 1, 0, step_s=1.0, draft_s=0.03)
        if noisy.record(state, "speculative", accepted=0) == "off":
            break
    assert not state.speculating and steps < 100  # below 1.03 after ~40 misses (0.03 lost per step until then)
    m = DriftMonitor()  # the round-based (server) monitor prices the same way
    m.observe_round(1, 1, 1.0)
    m.observe_round(1, 2, 0.9, 1, 0.05)
    assert m.threshold == pytest.approx(1.05)


def test_a_window_is_judged_shrunk_toward_the_long_run_tau():
    """A stream's window is judged as if PRIOR_STEPS more steps had come in at its shape's long-run tau: a
    drafter that has paid all along (tau ~3 over 200 steps) rides out a run of 8 misses, which judged alone
    (prior_steps 0, the rule before session 56: the negative control) switches it off; a drafter that has
    never had a draft accepted still switches off after min_steps."""
    def stream(prior_steps: int, history: int) -> tuple[FrozenCosts, object]:
        m = FrozenCosts(plain=1.0, verify_per_token=0.15, draft_per_level=0.05)  # chain 3 breaks even at 1.6
        m.prior_steps = prior_steps
        state = m.start(TreeShape.chain(3))
        assert m.threshold == pytest.approx(1.6) and state.speculating
        for _ in range(history):
            m.learn_acceptance(None, 3, 2)  # two of three drafted tokens accepted: tau 3
        return m, state

    def misses(m, state, n: int) -> list:
        verdicts = []
        for _ in range(n):
            m.observe_step("speculative", 4, 3, 0, step_s=1.6, draft_s=0.15)
            verdicts.append(m.record(state, "speculative", accepted=0))
        return verdicts

    m, state = stream(fallback_module.PRIOR_STEPS, history=200)
    assert m.expected_shape_tau(TreeShape.chain(3)) > 2.8
    assert misses(m, state, 8) == [None] * 8 and state.speculating
    assert m.judged_tau(state) > 1.6 > statistics.fmean(state.window)
    m, state = stream(0, history=200)
    assert misses(m, state, 8)[-1] == "off"  # judged alone: off
    m, state = stream(fallback_module.PRIOR_STEPS, history=0)
    assert misses(m, state, 8) == [None] * 7 + ["off"]  # no history but misses: off after min_steps


def test_acceptance_is_learned_from_verified_chains():
    m = FrozenCosts()
    assert m.expected_tau(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # the prior
    m.shape = TreeShape.chain(2)
    for _ in range(200):
        StreamMonitor.observe_step(m, "speculative", 3, 2, 2, step_s=1.0, draft_s=0.1)  # always accepted
    assert m.acceptance(1) > 0.95 and m.acceptance(3) == m.acceptance(2) > 0.95
    m.shape = TreeShape(3, 2, 6)
    StreamMonitor.observe_step(m, "speculative", 6, 2, 0, step_s=1.0, draft_s=0.1)  # a tree that does not say
    assert m.reached == [200, 200]  # what its top-1 chain had accepted teaches no chain's rate


def test_tree_steps_teach_their_ratio_their_top1_chain_and_their_own_draft_cost():
    m = FrozenCosts(draft_per_level=0.02)
    m.shape = TreeShape(4, 4, 16)
    assert m.tree_ratio(m.shape) == pytest.approx(PRIOR_TREE_RATIO["greedy"])  # nothing measured yet
    draft_curve = dict(m.draft.points)
    for _ in range(100):  # 3 accepted a step, 2 of them on the top-1 chain, whose 3rd token was rejected
        StreamMonitor.observe_step(m, "speculative", 16, 4, 3, step_s=1.0, draft_s=0.3, top_ranked=2, top_depth=4)
    assert m.trees["4,4,16"] == [100, 300, 200]
    prior = PRIOR_TREE_RATIO["greedy"]
    assert m.tree_ratio(m.shape) == pytest.approx((prior * TREE_PRIOR_WEIGHT + 300) / (TREE_PRIOR_WEIGHT + 200))
    assert m.reached == [100, 100, 100, 0] and m.accepted == [100, 100, 0, 0]  # the top-1 chain's step
    assert m.draft_cost(m.shape) == pytest.approx(0.3) and m.draft.points == draft_curve  # not a chain's cost
    chain4 = m.expected_tau(4)
    assert m.expected_shape_tau(m.shape) == pytest.approx(1 + (chain4 - 1) * m.tree_ratio(m.shape))
    assert m.expected_shape_tau(TreeShape.chain(4)) == chain4


def test_choose_shape_takes_the_tree_where_a_wide_verify_is_cheap_and_a_chain_where_it_is_not():
    flat = FrozenCosts(plain=1.0, verify_per_token=0.005, draft_per_level=0.05)  # an AMX CPU: 16 tokens ~ 1
    steep = FrozenCosts(plain=1.0, verify_per_token=0.1, draft_per_level=0.05)  # 16 tokens cost 2.5 plain steps
    never = FrozenCosts(plain=1.0, verify_per_token=0.005, draft_per_level=0.05)
    for m, rate in ((flat, 0.7), (steep, 0.7), (never, 0.0)):
        m.reached, m.accepted = [1000] * 8, [int(1000 * rate)] * 8
    unknown, _ = flat.choose_shape()
    assert unknown.is_chain  # a tree whose drafting was never timed is not priced
    for m in (flat, steep, never):
        price_tree(m, 0.25)
    assert flat.choose_shape()[0] == TreeShape(4, 4, 16)
    assert steep.choose_shape()[0].is_chain and steep.speedup(TreeShape(4, 4, 16)) < steep.choose_shape()[1]
    assert never.speedup(TreeShape(4, 4, 16)) < 1  # a drafter never accepted: the tree does not pay either
    flat.shape = TreeShape(4, 4, 16)
    assert flat.threshold == pytest.approx((0.25 + 1.075) / 1.0)  # the tree's own drafting cost
    assert not never.start(TreeShape(4, 4, 16)).speculating


def test_the_drafted_shape_stays_unless_another_is_clearly_faster():
    m = FrozenCosts()
    tree, close, far = TreeShape(4, 4, 16), TreeShape.chain(3), TreeShape.chain(2)
    speedups = {tree: 1.50, close: 1.45, far: 1.40}  # every other chain: None (unpriced)
    m.speedup = lambda shape, floor=True: speedups.get(shape)
    assert m.choose_shape()[0] == tree
    assert m.choose_shape(current=close) == (close, 1.45)  # within SHAPE_MARGIN of the best: kept
    assert m.choose_shape(current=far)[0] == tree


def test_chains_are_priced_one_level_past_the_deepest_measured():
    m = FrozenCosts(plain=1.0, verify_per_token=0.0, draft_per_level=0.01)  # deep chains nearly free
    assert m.choose_shape(trees=())[0].depth == 4  # nothing measured: up to MIN_PRICED_CHAIN
    m.reached, m.accepted = [100] * 5 + [1], [90] * 5 + [1]  # depth 6 reached once: not measured
    assert m.measured_depth() == 5 and m.choose_shape(trees=())[0].depth == 6
    m.reached, m.accepted = [100] * 8, [90] * 8
    assert m.choose_shape(trees=())[0].depth == 8


def test_a_tree_the_costs_choose_decodes_losslessly():
    """generate's default path drafting the 4,4,16 tree its costs chose (float64, greedy): token for token
    what plain decoding gives, with the fallback on and steps actually speculative."""
    target = tiny_target("llama")
    engine = Engine(target, random_drafter(target))
    engine.monitor = FrozenCosts(plain=1.0, verify_per_token=0.001, draft_per_level=0.05)
    engine.monitor.reached, engine.monitor.accepted = [1000] * 8, [800] * 8
    price_tree(engine.monitor, 0.1)
    for prompt in prompts(3):
        ref = engine.generate(prompt.tolist(), max_new_tokens=24, speculative=False).token_ids
        assert engine.generate(prompt.tolist(), max_new_tokens=24).token_ids == ref
    assert engine.shape == TreeShape(4, 4, 16) and engine.shape_source.startswith("measured")
    assert "speculative" in engine.monitor.kinds


def test_sampled_decoding_drafts_the_measured_chain_where_greedy_drafts_the_tree():
    target = tiny_target("llama")
    engine = Engine(target, random_drafter(target))
    engine.monitor = FrozenCosts(plain=1.0, verify_per_token=0.001, draft_per_level=0.05)
    engine.monitor.reached, engine.monitor.accepted = [1000] * 8, [800] * 8
    price_tree(engine.monitor, 0.1)
    assert engine.shape_for(SamplingParams()) == TreeShape(4, 4, 16)
    sampled = engine.shape_for(SamplingParams(temperature=1.0))
    assert sampled.is_chain and sampled == engine.monitor.choose_shape(trees=())[0]
    given = Engine(target, random_drafter(target), TreeShape(4, 4, 16))
    assert given.shape_for(SamplingParams(temperature=1.0)) == TreeShape(4, 4, 16)  # a given shape is kept


def test_top_ranked_run_counts_the_accepted_top1_chain():
    # root 0; level 1: 1 (best), 2; level 2: 3 (best child of 1), 4 (child of 2); level 3: 5 (child of 3)
    tree = DraftTree(torch.arange(6), [-1, 0, 0, 1, 2, 3])
    assert tree.top_ranked_depth == 3
    assert tree.top_ranked_run([0, 1, 3, 5]) == 3
    assert tree.top_ranked_run([0, 1, 3]) == 2
    assert tree.top_ranked_run([0, 2, 4]) == 0  # accepted off the top-1 chain
    assert tree.top_ranked_run([0]) == 0
    chain = DraftTree.chain(torch.arange(4))
    assert chain.top_ranked_depth == 3 and chain.top_ranked_run([0, 1, 2]) == 2


def test_calibration_measures_costs_and_leaves_the_proposer_clean():
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target))
    monitor = StreamMonitor()
    monitor.calibrate(target, proposer, context=24, sizes=(2, 4, 8), depths=(1, 3), repeats=1)
    assert monitor.calibrated
    assert all(monitor.verify(n) > 0 for n in (1, 2, 4, 8)) and all(monitor.draft(d) > 0 for d in (1, 3))
    assert proposer.cache.length == 0 and proposer.root is None
    ref = generate_vanilla(target, prompts()[0], GenerationConfig(max_new_tokens=20)).token_ids
    res = generate_speculative(target, proposer, prompts()[0], GenerationConfig(max_new_tokens=20),
                               TreeShape.chain(2), fallback=monitor)
    assert res.token_ids == ref


def test_engine_measures_its_shape_and_falls_back_by_default():
    target = tiny_target("llama")
    drafter = random_drafter(target)
    engine = Engine(target, drafter)
    assert engine.monitor.enabled and not engine.monitor.calibrated
    shape = engine.shape
    assert engine.monitor.calibrated and engine.shape_source.startswith("measured")
    assert shape.is_chain or shape in TREE_CANDIDATES
    ref = engine.generate(prompts()[0].tolist(), max_new_tokens=24, speculative=False).token_ids
    assert engine.generate(prompts()[0].tolist(), max_new_tokens=24).token_ids == ref
    given = Engine(target, drafter, TreeShape(2, 2, 4), fallback=False)
    assert given.shape == TreeShape(2, 2, 4) and given.shape_source == "given" and not given.monitor.enabled
    res = given.generate(prompts()[0].tolist(), max_new_tokens=24)
    assert res.token_ids == ref and res.stats.fallback_switches == 0


def test_a_wrong_plain_step_inside_the_speculative_loop_is_caught(monkeypatch):
    """Negative control: a plain step that loses its KV row breaks the output only where the
    fallback takes plain steps mid-generation, and the equality checks above see it."""
    target = tiny_target("llama")
    shape = TreeShape.chain(3)
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=30)
    refs = [generate_vanilla(target, prompt, cfg).token_ids for prompt in prompts(3)]  # before the bug
    real = SpeculativeDecoding._commit
    monkeypatch.setattr(SpeculativeDecoding, "_commit",
                        lambda self, keep, written: real(self, [] if written == 1 else keep, written))
    differs = 0
    for prompt, ref in zip(prompts(3), refs):
        # without the fallback a plain step comes last, if at all: its lost row is never read
        assert generate_speculative(target, proposer, prompt, cfg, shape).token_ids == ref
        switched = generate_speculative(target, proposer, prompt, cfg, shape, fallback=switching(threshold=1.5))
        differs += switched.token_ids != ref
    assert differs >= 2


def test_step_reports_carry_the_draft_depth():
    target = tiny_target("llama")
    dec = SpeculativeDecoding(target, OracleProposer(target), prompts()[0], GenerationConfig(max_new_tokens=20),
                              TreeShape(2, 3, 6))
    dec.step()
    report = dec.step()
    assert report.kind == "speculative" and report.depth == 3 and report.accepted == 3
    assert report.top_ranked == 3 and report.top_depth == 3  # the oracle's argmax leads every level
    assert dec.step(speculate=False).depth == 0


def test_small_verify_sizes_each_keep_their_own_cost():
    """A CPU GEMM of 2-3 rows can cost more than one of 4: measured sizes are not interpolated."""
    from anchorspec.decode.fallback import CostCurve

    curve = CostCurve(0.5)
    for n, seconds in ((1, 1.0), (2, 2.1), (3, 3.0), (4, 1.8), (8, 2.2)):
        curve.add(n, seconds)
    assert [curve(n) for n in (1, 2, 3, 4, 8)] == [1.0, 2.1, 3.0, 1.8, 2.2]
    assert curve(6) == pytest.approx(2.0)  # between measured points: interpolated
    curve.add(17, 5.0)
    curve.add(31, 7.0)  # 17-31 share one bucket above 16
    assert len(curve.points) == 6 and curve(24) == pytest.approx(6.0)


def test_monitor_state_round_trips_and_bad_states_are_refused():
    m = FrozenCosts(plain=1.0, verify_per_token=0.1, draft_per_level=0.05)
    m.shape = TreeShape.chain(3)
    for accepted in (3, 1, 0, 2, 3):
        StreamMonitor.observe_step(m, "speculative", 4, 3, accepted, step_s=1.5, draft_s=0.2)
    m.shape = TreeShape(4, 4, 16)
    StreamMonitor.observe_step(m, "speculative", 16, 4, 3, step_s=1.5, draft_s=0.3, top_ranked=1, top_depth=4)
    fresh = StreamMonitor()
    assert not fresh.calibrated
    assert fresh.restore(m.state())
    assert fresh.calibrated and fresh.state() == m.state()
    assert fresh.choose_shape() == m.choose_shape() and fresh.expected_tau(4) == m.expected_tau(4)
    assert fresh.trees == {"4,4,16": [1, 3, 1]} and fresh.tree_ratio(m.shape) == m.tree_ratio(m.shape)
    good = m.state()

    def greedy(**change):
        return {**good, "acceptance": {**good["acceptance"], "greedy": {**good["acceptance"]["greedy"], **change}}}

    for bad in ({**good, "version": 0}, greedy(accepted=[9, 0, 0]), {**good, "verify": [[1, -1.0]]},
                greedy(reached="x"), {"version": good["version"]}, [], greedy(trees={"x": [1, 1, 1]}),
                greedy(trees={"4,4,16": [1, 2]}), {**good, "tree_draft": {"4,4,16": -1.0}}, {**good, "acceptance": []}):
        other = StreamMonitor()
        assert not other.restore(bad) and not other.calibrated and other.reached == []
    partial = StreamMonitor()  # a plain step alone is no calibration
    assert partial.restore({**good, "verify": [[1, 1.0]]}) and not partial.calibrated


def test_what_a_stream_learned_of_copied_chains_outlives_its_process():
    """ChainChoice is kept in the stream's state (the costs file a CLI run's next process reads): restored, the same
    chains are verified alone; a state without it (before session 78) starts from the priors; damaged counts are
    refused."""
    m = chain_priced(plain=1.0, verify_per_token=0.05, draft_per_level=0.1)
    teach_chains(m, 8, 20, chain_accepted=8, accepted=8, rows=8)
    teach_chains(m, 2, 20, chain_accepted=0, accepted=2, rows=2)
    fresh = chain_priced(plain=1.0, verify_per_token=0.05, draft_per_level=0.1)
    assert not fresh.chain_alone(8)
    assert fresh.restore(json.loads(json.dumps(m.state())))
    assert fresh.chain_alone(8) and not fresh.chain_alone(2)
    for found in (2, 8):
        assert fresh.chain_choice.chain_tokens(found) == pytest.approx(m.chain_choice.chain_tokens(found))
        assert fresh.chain_choice.drafter_gain(found, 1.0) == pytest.approx(m.chain_choice.drafter_gain(found, 1.0))
    good = m.state()
    older = StreamMonitor()
    assert older.restore({k: v for k, v in good.items() if k != "chain_choice"})
    assert older.chain_choice.merged == {} and older.chain_choice.chains.counts == {}
    chains = good["chain_choice"]["chains"]
    for bad in ({"chains": {**chains, "8": chains["8"][:3]}}, {"chains": {"2": [[1.0, 2.0], [0.0, 0.0]]}},
                {"merged": {"2": [1.0, -1.0, 2.0]}}):
        assert not StreamMonitor().restore({**good, "chain_choice": bad})


def test_greedy_and_sampled_steps_are_priced_and_judged_apart():
    """A stream keeps acceptance, the tree ratio's prior and the global window per sampling regime: greedy
    steps that accept everything do not price a sampled stream's chains, and sampled steps that accept
    nothing neither close greedy decoding's gate nor lower its chosen depth."""
    m = FrozenCosts(plain=1.0, verify_per_token=0.02, draft_per_level=0.05)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    state = m.start(TreeShape.chain(4), greedy)
    for _ in range(200):  # a greedy stream whose chains of 4 are always accepted
        m.learn_acceptance(None, 4, 4)
        m.record(state, "speculative", 4)
    deep = m.choose_shape(trees=())[0]
    assert m.regime == "greedy" and deep.depth >= 4 and m.global_speculating
    state = m.start(TreeShape.chain(4), sampled)
    assert m.regime == "sampled" and m.reached == [] and m.expected_tau(3) == pytest.approx(1.875)  # its prior
    assert m.tree_ratio(TreeShape(4, 4, 16)) == pytest.approx(PRIOR_TREE_RATIO["sampled"])
    assert sampled_misses_until_off(m, state) == m.min_steps  # ... and a sampled one whose drafts never are
    assert not m.global_speculating and m.choose_shape(trees=())[0].depth < deep.depth
    m.select(greedy)
    assert m.global_speculating and m.choose_shape(trees=())[0] == deep and m.acceptance(4) > 0.95
    fresh = StreamMonitor()
    assert fresh.restore(m.state())
    for regime in (greedy, sampled):
        assert (fresh.select(regime), fresh.expected_tau(4)) == (m.select(regime), m.expected_tau(4))


def sampled_misses_until_off(m: StreamMonitor, state, steps: int = 200) -> int | None:
    """Feed `m` `steps` sampled chain-4 steps that accept nothing; the first at which the stream switches off."""
    off = None
    for step in range(1, steps + 1):
        m.learn_acceptance(None, 4, 0)
        if m.record(state, "speculative", 0) == "off" and off is None:
            off = step
    return off


def test_one_acceptance_set_for_both_regimes_keeps_a_losing_sampled_stream_on():
    """Negative control for the test above: with one set (session 72's monitor), a sampled window of misses is
    shrunk toward greedy's long-run tau and judged above the break-even: in 200 steps it never switches off."""
    m = FrozenCosts(plain=1.0, verify_per_token=0.02, draft_per_level=0.05)
    m.learned["sampled"], m.recent_by_regime["sampled"] = m.learned["greedy"], m.recent_by_regime["greedy"]
    state = m.start(TreeShape.chain(4), SamplingParams())
    for _ in range(200):
        m.learn_acceptance(None, 4, 4)
        m.record(state, "speculative", 4)
    assert sampled_misses_until_off(m, m.start(TreeShape.chain(4), SamplingParams(temperature=1.0))) is None


def test_the_servers_gate_judges_each_regime_on_its_own_requests():
    """The round-based monitor gates a new request on its regime's recent steps: a server whose sampled requests'
    drafts all fail starts new sampled requests plain, while greedy ones, whose drafts pay, still speculate (and
    the other way round); pooled (regime None: the gauges, probes of a mixed batch) it sees both."""
    for paying, losing in (("greedy", "sampled"), ("sampled", "greedy")):
        m = DriftMonitor(threshold=1.5)
        good, bad = m.new_request(regime=paying), m.new_request(regime=losing)
        for _ in range(m.global_min_steps):
            m.record(good, "speculative", 3)
            m.record(bad, "speculative", 0)
        assert m.new_request(regime=paying).speculating and not m.new_request(regime=losing).speculating
        assert m.global_tau == pytest.approx(2.5) and m.global_speculating  # pooled: 2.5 >= 1.5


def test_a_version_2_state_is_taken_as_greedy_decodings():
    """Sessions 41-72 kept one acceptance set for every regime: its costs and acceptance come back as
    greedy's (the default temperature); sampled decoding starts from its prior."""
    m = FrozenCosts(plain=1.0, verify_per_token=0.1, draft_per_level=0.05)
    for accepted in (3, 1, 0, 2, 3):
        m.learn_acceptance(None, 3, accepted)
    new = m.state()
    old = {k: v for k, v in new.items() if k != "acceptance"} | {"version": 2, **new["acceptance"]["greedy"]}
    restored = StreamMonitor()
    assert restored.restore(old) and restored.calibrated
    assert restored.reached == m.reached and restored.expected_tau(4) == m.expected_tau(4)
    restored.select(SamplingParams(temperature=0.7))
    assert restored.reached == [] and restored.trees == {}


def test_engine_starts_from_the_costs_an_earlier_engine_kept(tmp_path, monkeypatch):
    target = tiny_target("llama")
    drafter = random_drafter(target)
    costs = tmp_path / "costs" / "x.json"
    first = Engine(target, drafter, costs_file=costs)
    ref = first.generate(prompts()[0].tolist(), max_new_tokens=24, speculative=False).token_ids
    assert first.generate(prompts()[0].tolist(), max_new_tokens=24).token_ids == ref
    kept = json.loads(costs.read_text())
    assert kept == first.monitor.state() and kept["verify"] and kept["draft"]

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated although an earlier engine's costs were there")

    monkeypatch.setattr(StreamMonitor, "calibrate", no_calibration)
    second = Engine(target, drafter, costs_file=costs)
    assert second.monitor.calibrated and second.monitor.reached == kept["acceptance"]["greedy"]["reached"]
    assert second.generate(prompts()[0].tolist(), max_new_tokens=24).token_ids == ref
    assert "earlier runs" in second.shape_source
    greedy_reached = sum(json.loads(costs.read_text())["acceptance"]["greedy"]["reached"])
    assert greedy_reached >= sum(kept["acceptance"]["greedy"]["reached"])  # this run's steps added
    costs.write_text("{damaged")
    monkeypatch.undo()
    third = Engine(target, drafter, costs_file=costs)  # a damaged file: measured again, then rewritten
    assert not third.monitor.calibrated and third.generate(prompts()[0].tolist(), max_new_tokens=24).token_ids == ref
    assert json.loads(costs.read_text())["version"] == kept["version"]


@pytest.mark.parametrize("counts_as_compile", [True, False])
def test_a_step_that_compiled_is_no_cost_sample(counts_as_compile):
    """A compiled target's new step shape compiles inside a step (tens of seconds). The stream must
    not learn that as a verify's cost: one slow sample would price speculation out for hundreds of
    steps. Simulated: one verify forward sleeps 0.3 s; when it also counts as a compile (dynamo's
    graph counter grows) no cost point reaches 0.3 s, and when it does not (the negative control)
    the slow step shows up in the curve."""
    import time

    from torch._dynamo.utils import counters

    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target))
    ref = generate_vanilla(target, prompts()[0], GenerationConfig(max_new_tokens=20)).token_ids
    forward_rows, calls = target.forward_rows, []

    def slow_once(*args, **kwargs):
        calls.append(args[0].shape[1])
        if args[0].shape[1] > 1 and len([c for c in calls if c > 1]) == 2:  # the first verify (after the prefill)
            time.sleep(0.3)
            counters["stats"]["unique_graphs"] += counts_as_compile
        return forward_rows(*args, **kwargs)

    target.forward_rows = slow_once
    # a fixed break-even: it speculates throughout; smoothing 0: a bucket keeps its first sample
    monitor = StreamMonitor(threshold=1.0, smoothing=0.0, cost_window=None)
    res = generate_speculative(target, proposer, prompts()[0], GenerationConfig(max_new_tokens=20),
                               TreeShape.chain(3), fallback=monitor)
    assert res.token_ids == ref
    slowest = max(y for _, y in monitor.verify.points.values())
    assert (slowest < 0.3) == counts_as_compile


# --- exploring: a measured shape is checked against the other candidates now and then ----------------

def test_explore_takes_the_least_recently_drafted_plausible_candidate(monkeypatch):
    m = FrozenCosts()
    tree, chain3, chain2, chain1 = TreeShape(4, 4, 16), TreeShape.chain(3), TreeShape.chain(2), TreeShape.chain(1)
    speeds = {tree: 1.50, chain3: 1.45, chain2: 1.40, chain1: 1.0}  # chain 4: unpriced
    m.speedup = lambda shape, floor=True: speeds.get(shape)
    picks = [m.explore(tree) for _ in range(3 * EXPLORE_EVERY)]
    assert picks[:EXPLORE_EVERY - 1] == [None] * (EXPLORE_EVERY - 1)
    # never drafted first, then in turn; chain 1 (below EXPLORE_FLOOR x 1.5) and unpriced chain 4 never
    assert [p for p in picks if p is not None] == [chain3, chain2, chain3] and m.explored == 3
    speeds[chain3] = speeds[chain2] = 1.1  # every other candidate far behind: nothing explored
    assert [m.explore(tree) for _ in range(EXPLORE_EVERY)] == [None] * EXPLORE_EVERY and m.explored == 3


def test_calibrated_costs_are_replaced_by_the_first_real_step():
    m = StreamMonitor()
    m.verify.add(16, 1.6, provisional=True)
    m.verify.add(16, 1.1)  # a real step: replaces the guess
    assert m.verify(16) == pytest.approx(1.1)
    m.verify.add(16, 2.1)  # later real steps: the median of the last COST_WINDOW
    assert m.verify(16) == pytest.approx(1.6)
    m.verify.add(16, 1.2)  # one slow step among three does not move it
    assert m.verify(16) == pytest.approx(1.2)
    for _ in range(COST_WINDOW):  # only the last COST_WINDOW count
        m.verify.add(16, 1.0)
    assert m.verify(16) == pytest.approx(1.0)
    averaged = StreamMonitor(cost_window=None)  # the server's rule: moving averages (smoothing 0.2)
    averaged.verify.add(16, 1.1)
    averaged.verify.add(16, 2.1)
    assert averaged.verify(16) == pytest.approx(1.3)
    m.shape = TreeShape(4, 4, 16)
    price_tree(m, 0.9, provisional=True)
    m.follow_pace = False  # these real steps' times are taken as they are (test_costs_follow_the_hosts_pace)
    assert m.priced_on_calibration(m.shape)
    StreamMonitor.observe_step(m, "speculative", 16, 4, 2, step_s=1.5, draft_s=0.3, top_ranked=1, top_depth=4)
    assert m.draft_cost(m.shape) == pytest.approx(0.3) and not m.priced_on_calibration(m.shape)
    for draft_s in (0.9, 0.31):  # a tree's drafting time: the same median
        StreamMonitor.observe_step(m, "speculative", 16, 4, 2, step_s=1.5, draft_s=draft_s, top_ranked=1, top_depth=4)
    assert m.draft_cost(m.shape) == pytest.approx(0.31)
    fresh = StreamMonitor()  # which costs are guesses survives the trip through the costs file
    m.draft.add(3, 0.2, provisional=True)
    assert fresh.restore(m.state()) and fresh.draft.provisional == {3} and fresh.state() == m.state()


def simulate_stream(m: StreamMonitor, steps: int, explore: bool, prompt_steps: int = 50, pace=lambda step: 1.0,
                    on_prompt=lambda step: None) -> TreeShape:
    """A stream on a machine where a chain of d verifies in 1.0 s and drafts in 0.05 d s, and the 4,4,16
    tree verifies in 1.1 s and drafts in 0.25 s, all of it `pace(step)` times slower at a given step; a
    chain accepts its first 2 tokens and never a 3rd, the tree 3 tokens, 2 of them on its top-1 chain.
    Its shape is chosen anew every `prompt_steps` steps, as `generate` chooses it per prompt, after
    `on_prompt(step)`. Returns the shape it ends with."""
    current = m.shape = m.choose_shape()[0]
    for i in range(steps):
        if i and i % prompt_steps == 0:
            on_prompt(i)
            current = m.shape = m.choose_shape(current=current)[0]  # as generate starts the next prompt
        drafted = (m.explore(current) if explore else None) or current
        if drafted.is_chain:
            draft, verify, accepted, top = 0.05 * drafted.depth, 1.0, min(drafted.depth, 2), None
        else:
            draft, verify, accepted, top = 0.25, 1.1, 3, 2
        draft, verify = draft * pace(i), verify * pace(i)
        StreamMonitor.observe_step(m, "speculative", drafted.total_tokens, drafted.depth, accepted, draft + verify,
                                   draft, top_ranked=top, top_depth=drafted.depth if top else None, shape=drafted)
    return current


def calibrated_monitor(tree_verify: float, provisional: bool = True) -> StreamMonitor:
    """simulate_stream's machine as a calibration saw it, except the tree's 16-token verify (really 1.1 s),
    priced `tree_verify`: by the calibration, or (`provisional` False) by one real step."""
    m = StreamMonitor()
    for n in range(1, 10):
        m.verify.add(n, 1.0, provisional=True)
    m.verify.add(16, tree_verify, provisional=provisional)
    for d in (1, 4):
        m.draft.add(d, 0.05 * d, provisional=True)
    price_tree(m, 0.25, provisional=True)
    m.calibrated = True
    return m


def test_exploring_corrects_a_stale_tree_cost_and_the_stream_returns_to_the_tree():
    """Session 40: the calibration priced the tree's 16-token verify far above what it costs, the
    stream drafted chains and never came back. With exploring, one real tree step corrects the
    price and the stream takes the tree; without (the negative control) it stays on chains."""
    tree = TreeShape(4, 4, 16)
    stuck = calibrated_monitor(1.5)
    assert simulate_stream(stuck, 400, explore=False).is_chain and "4,4,16" not in stuck.trees
    assert stuck.verify(16) == pytest.approx(1.5)
    explored = calibrated_monitor(1.5)
    assert simulate_stream(explored, 400, explore=True) == tree
    assert explored.verify(16) == pytest.approx(1.1) and explored.explored > 0


def old_explore_rule(m: StreamMonitor) -> StreamMonitor:
    """Sessions 41-42's rule: the floor alone decides which candidates are explored."""
    m.priced_on_calibration = lambda shape: False
    m.explore_stale = math.inf
    return m


def test_a_tree_the_calibration_priced_under_the_floor_is_still_explored():
    """Session 42's chains: the calibration priced the tree so high that it fell under EXPLORE_FLOOR of
    the chain drafted, so it was never explored and its guess never replaced. A shape priced on the
    calibration alone is explored anyway; under the floor-only rule (the control) the stream stays on chains."""
    tree = TreeShape(4, 4, 16)
    stuck = old_explore_rule(calibrated_monitor(2.2))
    assert simulate_stream(stuck, 400, explore=True).is_chain and "4,4,16" not in stuck.trees
    assert stuck.speedup(tree) < EXPLORE_FLOOR * stuck.speedup(stuck.choose_shape()[0])  # under the floor throughout
    fixed = calibrated_monitor(2.2)
    assert simulate_stream(fixed, 400, explore=True) == tree
    assert fixed.verify(16) == pytest.approx(1.1) and fixed.explored_shapes["4,4,16"] >= 1


def test_a_shape_left_on_one_unlucky_real_step_is_explored_again_once_stale():
    """A real tree step that ran slow (2.0 s against 1.1) put the tree under the floor; the floor alone
    (the control) never drafts it again, while staleness (EXPLORE_STALE explore calls) re-drafts it until
    its cost has come back and the stream takes the tree."""
    tree = TreeShape(4, 4, 16)
    stuck = old_explore_rule(calibrated_monitor(2.0, provisional=False))
    assert simulate_stream(stuck, 3000, explore=True).is_chain and stuck.verify(16) == pytest.approx(2.0)
    fixed = calibrated_monitor(2.0, provisional=False)
    assert simulate_stream(fixed, 3000, explore=True) == tree
    # the tree was re-drafted as it went stale (at most once per EXPLORE_STALE calls) until it was plausible
    assert fixed.explored_shapes["4,4,16"] >= 2 and fixed.verify(16) < 1.3


def test_costs_follow_the_hosts_pace():
    """A host whose speed steps between 1x and 1.3x every 120 steps (session 43 saw 57-77 ms for the same
    tree step from prompt to prompt): the tree and chain 4, each drafted mostly when explored, are priced
    against each other at their true ratio at most prompts (median error < 2 %), because each step is held
    against its neighbours. In seconds as measured (the control) an explored shape is priced at another
    moment's speed: a quarter of the prompts are priced over 10 % off (mean error 4.8 % against 0.9 %). (Before
    session 81 the control's median error was over 10 %: a cost curve priced a measured point at its smaller
    neighbour's cost where the host's pace had made the segment fall.)"""
    tree, chain4 = TreeShape(4, 4, 16), TreeShape.chain(4)
    truth = (1.1 + 0.25) / (1.0 + 0.2)

    def errors(m: StreamMonitor) -> list[float]:
        seen = []

        def check(step):
            if step >= 400:  # every candidate measured on real steps by then
                seen.append(abs(m.relative_step_cost(tree) / m.relative_step_cost(chain4) / truth - 1))
        m.reached, m.accepted = [1000] * 8, [600] * 8  # chain 4 and the tree expected level:
        m.trees["4,4,16"] = [1000, 1000, 1000]         # both are drafted as the costs sway
        simulate_stream(m, 2400, explore=True, pace=lambda step: 1.3 if step // 120 % 2 else 1.0, on_prompt=check)
        assert m.explored_shapes["4,4,16"] >= 3 and m.explored_shapes["1,4,5"] >= 3
        return seen

    paced = errors(calibrated_monitor(1.1))
    assert statistics.median(paced) < 0.02 and statistics.fmean(paced) < 0.02
    in_seconds = calibrated_monitor(1.1)
    in_seconds.follow_pace = False
    unpaced = errors(in_seconds)
    assert statistics.fmean(unpaced) > 0.04 and sum(e > 0.10 for e in unpaced) >= 2 * sum(e > 0.10 for e in paced)


def test_the_pace_is_set_by_the_streams_shape_against_the_median_of_its_first_steps():
    """The unit is the median of the shape's first PACE_WINDOW steps, so one slow first step (a cold
    cache) sets nothing; then a tree step drafted while the host runs 1.3x slow is priced at its usual
    cost, and the stream's own shape keeps its unit."""
    m = StreamMonitor()
    m.shape, tree = TreeShape.chain(4), TreeShape(4, 4, 16)

    def chain_step(host):
        StreamMonitor.observe_step(m, "speculative", 5, 4, 2, step_s=1.2 * host, draft_s=0.2 * host)
    for host in [2.0] + [1.0] * (PACE_WINDOW - 1):
        chain_step(host)
    assert m.unit == ("1,4,5", pytest.approx(1.2)) and m.pace() == pytest.approx(1.0)
    for _ in range(PACE_WINDOW):
        chain_step(1.3)
    assert m.pace() == pytest.approx(1.3)
    StreamMonitor.observe_step(m, "speculative", 16, 4, 3, step_s=1.35 * 1.3, draft_s=0.25 * 1.3, top_ranked=2,
                               top_depth=4, shape=tree)
    assert m.draft_cost(tree) + m.verify(16) == pytest.approx(1.35)
    assert m.draft_cost(m.shape) + m.verify(5) == pytest.approx(1.2)


@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_greedy_lossless_while_exploring(drafter, monkeypatch):
    """generate's measured shape with a step in two drafted with another candidate (float64): token
    for token what plain decoding gives, and the explored steps happened."""
    monkeypatch.setattr(fallback_module, "EXPLORE_EVERY", 2)
    target = tiny_target("llama")
    engine = Engine(target, random_drafter(target))
    if drafter == "oracle":
        engine.proposer = OracleProposer(target)
    engine.monitor = FrozenCosts(plain=1.0, verify_per_token=0.001, draft_per_level=0.02)
    engine.monitor.reached, engine.monitor.accepted = [1000] * 8, [800] * 8
    price_tree(engine.monitor, 0.1)
    explored = 0
    for prompt in prompts(3):
        ref = engine.generate(prompt.tolist(), max_new_tokens=30, speculative=False).token_ids
        res = engine.generate(prompt.tolist(), max_new_tokens=30)
        assert res.token_ids == ref
        explored += res.stats.explored_steps
    assert explored >= 3 and engine.monitor.explored == explored
    given = engine.generate(prompts()[0].tolist(), max_new_tokens=30, shape=TreeShape(4, 4, 16))
    assert given.stats.explored_steps == 0  # a shape the caller gave is drafted as given


def test_sampling_while_exploring_matches_target_distribution(setup, monkeypatch):  # noqa: F811
    """Which shape a step drafts depends only on earlier steps: the output keeps the target's distribution."""
    monkeypatch.setattr(fallback_module, "EXPLORE_EVERY", 2)
    target, proposer = setup
    monitor = FrozenCosts(plain=1.0, verify_per_token=0.001, draft_per_level=0.02)
    monitor.reached, monitor.accepted = [1000] * 8, [800] * 8
    price_tree(monitor, 0.05, TreeShape(3, 3, 8))
    n = 1200
    samples = torch.zeros(n, NEW, dtype=torch.long)
    explored = 0
    for i in range(n):
        cfg = GenerationConfig(max_new_tokens=NEW, sampling=PARAMS, seed=30_000 + i)
        res = generate_speculative(target, proposer, PROMPT, cfg, TreeShape.chain(3), fallback=monitor,
                                   explore=(TreeShape(3, 3, 8),))
        samples[i] = torch.tensor(res.token_ids)
        explored += res.stats.explored_steps
    assert explored > n // 4
    assert worst_p_value(samples, exact_distribution(target)) > 1e-3


def test_shapes_are_ranked_on_measured_verify_costs_and_the_floor_only_weighs_plain_decoding():
    """Where a 4-token verify runs faster than a plain step, flooring it at the plain step (at_least) priced the
    chain high and the tree, dearer than a plain step anyway, not at all: the tree won on the floor alone."""
    m = FrozenCosts(plain=1.0, draft_per_level=0.05)
    m.verify.add(5, 0.80)  # the chain's verify: faster than the plain step
    m.verify.add(16, 1.30)  # the tree's
    m.reached, m.accepted = [1000] * 8, [600] * 8
    price_tree(m, 0.25)
    chain, tree = TreeShape.chain(4), TreeShape(4, 4, 16)
    assert m.speedup(tree) > m.speedup(chain)  # the floored prices alone would choose the tree ...
    assert m.speedup(chain, floor=False) > m.speedup(tree, floor=False)  # ... measured, the chain is faster
    best, speedup = m.choose_shape()
    assert best == chain and speedup == pytest.approx(m.speedup(chain))  # the floored figure decides plain or not
    assert m.choose_shape(current=tree)[0] == chain  # the kept shape is weighed on the same measured costs
    m.accepted = [0] * 8  # a drafter never accepted: tau 1, and even a verify cheaper than a plain step ...
    assert m.speedup(m.choose_shape()[0]) < 1  # ... is not taken as speculation that pays
    assert not m.start(m.choose_shape()[0]).speculating


def test_without_the_fallback_every_step_speculates_and_the_monitor_still_learns_the_drafter():
    """`fallback=False` speculates at every step, even below the break-even, yet its monitor learns the
    acceptance and costs of those steps, so a measured shape follows the drafter instead of the prior."""
    target = tiny_target("llama")
    engine = Engine(target, random_drafter(target), TreeShape.chain(3), fallback=False)
    engine.monitor.threshold_at = lambda rows=1: 9.0  # speculation never pays: an enabled monitor would switch
    for prompt in prompts(2):
        ref = engine.generate(prompt.tolist(), max_new_tokens=24, speculative=False).token_ids
        res = engine.generate(prompt.tolist(), max_new_tokens=24)
        assert res.token_ids == ref and res.stats.fallback_switches == 0 and res.stats.verify_steps > 0
    m = engine.monitor
    assert not m.calibrated  # a given shape needs no calibration
    assert m.reached[:3] and m.reached[0] >= res.stats.verify_steps  # every verified draft was counted
    assert m.verify(4) is not None  # ... and the cost of its 4-token verifies


def test_a_step_that_verified_only_a_copied_chain_teaches_the_verify_cost_and_nothing_of_the_drafter():
    """A step that verified a copied chain alone (kind "lookup": a switched-off step, or one ChainChoice chose)
    drafted nothing: the drafter's acceptance and drafting costs must not learn from it, but its time is a verify
    of its tokens, which the choice between the chain and the drafter's tree prices."""
    m = FrozenCosts()
    before = m.state()
    StreamMonitor.observe_step(m, "lookup", 9, 0, 0, 0.05, 0.001)
    after = m.state()
    assert after["acceptance"] == before["acceptance"] and after["draft"] == before["draft"]
    assert m.verify(9) == pytest.approx(0.049) and after["verify"] != before["verify"]
    StreamMonitor.observe_step(m, "speculative", 4, 3, 2, 0.05, 0.01)  # the control: a drafted step teaches both
    assert m.state()["acceptance"] != after["acceptance"] and m.state()["draft"] != after["draft"]




def _priced_monitor(acceptance: float) -> tuple[DriftMonitor, tuple[TreeShape, ...]]:
    """A server's monitor that chooses among a tree and two chains, each shape's rounds observed at 1, 4 and 16
    rows on costs where a forward reads the weights once and then pays per token (a CPU's): a wide round costs
    more the more rows it has. The drafter accepts `acceptance` of the drafts reaching each depth."""
    chain1, chain2, tree = TreeShape.chain(1), TreeShape.chain(2), TreeShape(4, 4, 16)
    monitor = DriftMonitor(smoothing=1.0)
    monitor.shapes = (tree, chain1, chain2)
    for rows in (1, 4, 16):
        for shape in monitor.shapes:
            monitor.shape = shape
            monitor.observe_round(rows, 1, 0.010 + 0.0002 * rows)
            monitor.observe_round(rows, shape.total_tokens, 0.010 + 0.0002 * rows * shape.total_tokens,
                                  draft_rows=rows, draft_s=0.0005 * shape.depth * (1 + rows / 4))
    monitor.reached, monitor.accepted = [1000] * 4, [round(1000 * acceptance)] * 4
    return monitor, monitor.shapes


def test_a_batch_drafts_the_shape_its_row_count_prices_fastest():
    """Each shape's rounds are priced apart (its drafting and width); a round of B rows drafts the shape whose
    expected tau over tau*(B) is best (here the tree alone, a chain of 2 at 16 rows), the current shape staying
    unless another is SHAPE_MARGIN faster; before a window can judge, a request joining a batch at which no shape is
    expected to pay starts plain, and one joining a lone request's batch speculates."""
    monitor, (tree, chain1, chain2) = _priced_monitor(0.8)
    assert monitor.threshold_at(16, tree) > 5 > 2 > monitor.threshold_at(16, chain2)  # priced apart
    assert monitor.threshold_at(1, chain1) < monitor.threshold_at(1, chain2) < monitor.threshold_at(1, tree)
    monitor.shape = chain1
    assert monitor.shape_for_rows(1, monitor.shapes) == tree
    assert monitor.shape_for_rows(16, monitor.shapes) == chain1  # chain 2 is faster, but by less than the margin
    monitor.shape = tree
    assert monitor.shape_for_rows(16, monitor.shapes) == chain2
    assert monitor.shape_for_rows(1, monitor.shapes) == tree
    assert monitor.new_request(rows=16).speculating  # chain 2 is expected at ~1.3x plain there

    weak, _ = _priced_monitor(0.1)  # a drafter that fits no one: at 16 rows nothing pays, alone a chain of 1 does
    assert max(weak.expected_speedup(16, s) for s in weak.shapes) < 1 < weak.expected_speedup(1, chain1)
    assert not weak.new_request(rows=16).speculating and weak.new_request(rows=1).speculating
    weak.shapes = ()  # one shape, not chosen: the window alone decides, as before (empty: speculate)
    assert weak.new_request(rows=16).speculating


def test_a_batch_with_a_tracked_shape_judges_its_pooled_lengths_shrunk_toward_the_shape_tau():
    """A few pooled lengths say little: with a shape tracked they are shrunk toward its long-run tau as a stream's
    window is (PRIOR_STEPS), so one unlucky round of 4 rows does not veto a shape expected to pay; many lengths
    outweigh the prior. With no shape tracked (one shape, not chosen) the mean is judged raw."""
    monitor, (_, _, chain2) = _priced_monitor(0.8)
    monitor.shape = chain2
    expected = monitor.expected_shape_tau(chain2)
    assert expected == pytest.approx(1 + 0.8 + 0.64, abs=0.01)
    few = monitor.pooled_tau([1, 1, 1, 1])
    assert few == pytest.approx((4 * 1 + PRIOR_STEPS * expected) / (4 + PRIOR_STEPS))
    assert few > monitor.threshold_at(4)  # still expected to pay: the batch keeps speculating
    assert monitor.pooled_tau([1] * 256) < monitor.threshold_at(4)  # a whole batch's windows of misses: it stops
    monitor.shape = None
    assert monitor.pooled_tau([1, 1, 1, 1]) == 1.0


def test_a_measured_point_is_its_own_cost_even_after_a_slower_smaller_one():
    """Between measured points cost never falls, but a measured point is its own cost: one slow round at 12 rows must
    not price every round of 16 rows, measured faster, at its time (a plain round priced at 2.3x its cost made every
    wide round look cheap)."""
    from anchorspec.decode.fallback import CostCurve

    curve = CostCurve(smoothing=0.1)
    for rows, seconds in ((1, 0.025), (4, 0.030), (12, 0.096), (16, 0.041)):
        curve.add(rows, seconds)
    assert curve(16) == 0.041 and curve(12) == 0.096
    assert curve(14) == pytest.approx(0.096)  # between them, flat (never falling)
    assert curve(8) == pytest.approx(0.030 + (0.096 - 0.030) * 4 / 8)
