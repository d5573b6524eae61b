"""Prompt lookup: the speculative loop with no drafter, drafting only the chain copied from where the
sequence's last tokens occurred before (decode/lookup.py; `generate_prompt_lookup`). Greedy output is
the target's own token for token (float64, every family, a stop token inside an accepted chain, the
token budget, batched rounds, a shared-prefix start, a sliding-window target); sampled output keeps
the target's distribution (the copied tokens are point-mass candidates), and an always-accepting
verifier is detected."""

from __future__ import annotations

import pytest
import torch

import anchorspec.decode.verify as verify
from anchorspec.api import Engine
from anchorspec.decode.batch import SharedPrefix
from anchorspec.decode.engine import (GenerationConfig, SpeculativeDecoding, generate_prompt_lookup,
                                      generate_vanilla)
from anchorspec.decode.fallback import ForwardCosts
from anchorspec.decode.lookup import CHAIN_MEMORY, ChainPlanner, LookupSettings
from anchorspec.decode.sampling import SamplingParams
from anchorspec.metrics import GenerationStats
from helpers import FAMILIES, tiny_target
from lookup_world import BATCH_PROMPTS, BATCH_TOKENS, PROMPTS, SINGLE, in_rounds, stop_inside_a_cycle
from sampling_world import PROMPT, exact_distribution, seeded_runs, worst_p_value

pytestmark = pytest.mark.usefixtures("one_thread")

LOOKUP = LookupSettings()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_prompt_lookup_is_the_targets_output_every_family(family):
    target = tiny_target(family)
    cfg = GenerationConfig(max_new_tokens=40)
    won = 0
    for prompt in PROMPTS:
        ref = generate_vanilla(target, prompt, cfg)
        res = generate_prompt_lookup(target, prompt, cfg, LOOKUP)
        assert res.token_ids == ref.token_ids and res.finish_reason == ref.finish_reason
        assert res.stats.lookup_rows == res.stats.drafted_tokens  # every drafted token was copied
        won += res.stats.lookup_tokens
    assert won > 0  # chains were accepted: the tiny targets cycle


def test_prompt_lookup_takes_fewer_target_forwards_where_the_output_cycles():
    target = tiny_target("qwen2")  # its greedy output is a 2-token cycle from the first token
    cfg = GenerationConfig(max_new_tokens=48)
    res = generate_prompt_lookup(target, PROMPTS[0], cfg, LOOKUP)
    assert res.token_ids == generate_vanilla(target, PROMPTS[0], cfg).token_ids
    assert res.stats.target_forwards + res.stats.verify_steps < 48 / 3  # 12: 8 before the cycle is seen twice
    assert res.stats.tau > 4


def test_stop_token_inside_an_accepted_chain():
    target, prompt, cfg, ref = stop_inside_a_cycle()
    res = generate_prompt_lookup(target, prompt, cfg, LOOKUP)
    assert res.token_ids == ref.token_ids and res.finish_reason == "stop"
    assert res.stats.lookup_tokens >= 4 and res.stats.verify_steps == 1  # the stop came from inside one chain


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9, 17])
def test_prompt_lookup_keeps_the_token_budget(max_new):
    target = tiny_target("qwen2")
    cfg = GenerationConfig(max_new_tokens=max_new)
    ref = generate_vanilla(target, PROMPTS[0], cfg)
    res = generate_prompt_lookup(target, PROMPTS[0], cfg, LookupSettings(max_tokens=32))
    assert res.token_ids == ref.token_ids and res.finish_reason == "length"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, 0.95)], ids=["greedy", "sampled"])
def test_batched_rounds_equal_solo_runs(sampling):
    target = tiny_target("llama")
    cfgs = [GenerationConfig(max_new_tokens=n, sampling=sampling, seed=7 + n) for n in BATCH_TOKENS]
    lookup = LOOKUP if sampling.greedy else SINGLE  # sampled text repeats single tokens, rarely pairs
    solo = [generate_prompt_lookup(target, p, c, lookup) for p, c in zip(BATCH_PROMPTS, cfgs)]
    decs = in_rounds(target, [SpeculativeDecoding(target, None, p, c, None, lookup=lookup)
                              for p, c in zip(BATCH_PROMPTS, cfgs)])
    assert [d.result().token_ids for d in decs] == [r.token_ids for r in solo]
    assert [d.result().stats.lookup_rows for d in decs] == [r.stats.lookup_rows for r in solo]
    assert sum(r.stats.lookup_tokens if sampling.greedy else r.stats.lookup_rows for r in solo) > 0


def test_a_shared_prefix_start_drafts_from_the_prompt():
    target = tiny_target("llama")
    prompt = PROMPTS[0]
    cfg = GenerationConfig(max_new_tokens=24)
    dec = SpeculativeDecoding(target, None, prompt, cfg, None, lookup=LOOKUP)
    dec.start_from(SharedPrefix.build(target, prompt[:-1]))
    res = dec.run()
    assert res.token_ids == generate_vanilla(target, prompt, cfg).token_ids
    assert res.stats.lookup_tokens > 0


def test_a_sliding_window_target_decodes_plainly():
    target = tiny_target("mistral")
    target.model.config.sliding_window = 8  # its cache cannot verify several rows: plain steps only
    cfg = GenerationConfig(max_new_tokens=24)
    res = generate_prompt_lookup(target, PROMPTS[0], cfg, LOOKUP)
    assert res.token_ids == generate_vanilla(target, PROMPTS[0], cfg).token_ids
    assert res.stats.verify_steps == 0


def test_engine_without_a_drafter_looks_up_when_asked():
    engine = Engine(tiny_target("qwen2"))
    ids = PROMPTS[0].tolist()
    plain = engine.generate(ids, max_new_tokens=32, lookup="default")  # without a drafter: plain decoding
    looked = engine.generate(ids, max_new_tokens=32, lookup=LOOKUP)
    assert looked.token_ids == plain.token_ids
    assert plain.stats.verify_steps == 0 and looked.stats.lookup_tokens > 0
    assert engine.generate(ids, max_new_tokens=32, lookup=LOOKUP, speculative=False).stats.verify_steps == 0


# single-token matches: in 4 + 4 tokens of an 8-token vocabulary a copied chain is proposed at most steps
SAMPLED_LOOKUP = LookupSettings(max_tokens=3, min_match=1, max_match=2)


def sampled_runs(target, n: int) -> tuple[torch.Tensor, GenerationStats]:
    """n seeded prompt-lookup generations of NEW tokens (seeded_runs)."""
    return seeded_runs(lambda cfg: generate_prompt_lookup(target, PROMPT, cfg, SAMPLED_LOOKUP), n, first_seed=20_000)


@pytest.fixture(scope="module")
def peaked_target():
    """A tiny 8-token target whose next-token distributions are peaked, so copied tokens are often right."""
    import transformers

    from anchorspec.models.target import Target
    from helpers import tiny_config

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=8, layers=4))
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return Target(model.to(torch.float64).eval())


def test_sampled_prompt_lookup_keeps_the_target_distribution(peaked_target):
    samples, stats = sampled_runs(peaked_target, 2500)
    assert stats.lookup_rows > 2500 and stats.lookup_tokens > 100  # copied tokens verified in most runs, often accepted
    assert worst_p_value(samples, exact_distribution(peaked_target)) > 1e-3


def test_an_always_accepting_verifier_is_detected(peaked_target, monkeypatch):
    monkeypatch.setattr(verify, "acceptance_probability", lambda p, q: 1.0)
    samples, _ = sampled_runs(peaked_target, 800)
    assert worst_p_value(samples, exact_distribution(peaked_target)) < 1e-6


# --- a batch's cap on copied chains (a server with no drafter: decode/lookup.ChainPlanner) ----------------------

def test_capped_chains_in_rounds_keep_the_greedy_output():
    """Every round caps the rows' chains at a random length (0: a plain round): each output is still the target's
    own, and the caps were applied (fewer copied rows verified than uncapped)."""
    target = tiny_target("llama")
    cfgs = [GenerationConfig(max_new_tokens=n) for n in BATCH_TOKENS]
    solo = [generate_vanilla(target, p, c) for p, c in zip(BATCH_PROMPTS, cfgs)]
    gen, caps = torch.Generator().manual_seed(0), []

    def chains(rows, found):
        assert rows >= len(found) and all(greedy and n >= 1 for greedy, n in found)
        caps.append((int(torch.randint(0, max(n for _, n in found) + 1, (), generator=gen)), max(n for _, n in found)))
        return caps[-1][0]

    decs = in_rounds(target, [SpeculativeDecoding(target, None, p, c, None, lookup=LOOKUP)
                              for p, c in zip(BATCH_PROMPTS, cfgs)], chains)
    assert [d.result().token_ids for d in decs] == [r.token_ids for r in solo]
    assert any(cap == 0 for cap, _ in caps) and any(0 < cap < longest for cap, longest in caps)
    assert sum(d.result().stats.lookup_tokens for d in decs) > 0
    whole = in_rounds(target, [SpeculativeDecoding(target, None, p, c, None, lookup=LOOKUP)
                               for p, c in zip(BATCH_PROMPTS, cfgs)])
    assert sum(d.result().stats.lookup_rows for d in decs) < sum(d.result().stats.lookup_rows for d in whole)


def test_a_chain_capped_to_nothing_is_a_plain_step_when_sampling():
    """Seeded sampling with every chain capped to 0 draws exactly what plain decoding draws with that seed."""
    target = tiny_target("llama")
    cfgs = [GenerationConfig(max_new_tokens=n, sampling=SamplingParams(1.0, 0.95), seed=7 + n) for n in BATCH_TOKENS]
    plain = [generate_vanilla(target, p, c) for p, c in zip(BATCH_PROMPTS, cfgs)]
    found = []
    decs = in_rounds(target, [SpeculativeDecoding(target, None, p, c, None, lookup=SINGLE)
                              for p, c in zip(BATCH_PROMPTS, cfgs)], lambda rows, chains: found.append(chains) or 0)
    assert [d.result().token_ids for d in decs] == [r.token_ids for r in plain]
    assert found and all(d.result().stats.lookup_rows == 0 for d in decs)


def flat_cost(plain: float, per_token: float):
    """A forward that costs `plain` plus `per_token` for each padded token past the first of each row."""
    return lambda rows, width: plain + per_token * rows * (width - 1)


def test_chain_planner_verifies_chains_where_they_cost_little_and_none_where_they_cost_much():
    found = [(True, 6), (True, 2)]
    assert ChainPlanner(flat_cost(1.0, 0.001)).cap(4, found) == 6  # prior p = 1/2 a position: 1.5 tokens won
    assert ChainPlanner(flat_cost(1.0, 1.0)).cap(4, found) == 0  # a width of 2 doubles the forward


def test_chain_planner_learns_acceptance_per_found_length_and_regime():
    planner = ChainPlanner(flat_cost(1.0, 0.02))
    for _ in range(200):
        planner.learn(True, 8, 8, 8)  # greedy chains found 8 long (deep in a repetition): all accepted
        planner.learn(True, 2, 2, 0)  # ... found 2 long (after a miss): never
        planner.learn(False, 8, 8, 0)  # sampled ones: never
    assert planner.acceptance(True, 8, 8) > 0.95 and planner.acceptance(True, 2, 1) < 0.05
    assert planner.acceptance(False, 8, 1) < 0.05 and planner.acceptance(False, 8, 2) == 0.5  # never reached: the prior
    assert planner.expected_by_offered(True, 8)[8] > 7.5 and planner.expected_by_offered(True, 8)[3] > 2.9
    assert planner.cap(4, [(True, 8)]) == 8 and planner.cap(4, [(True, 2)]) == 0 and planner.cap(4, [(False, 8)]) == 0
    assert planner.cap(4, [(True, 8), (True, 2)]) == 8  # the row after a miss does not cost the repetition its chain
    assert planner.cap(4, [(False, 8), (True, 4), (True, 8)]) == 8


def test_chain_planner_follows_a_change_of_traffic_and_retries_a_length_it_stopped_verifying():
    planner = ChainPlanner(flat_cost(1.0, 0.005))
    assert planner.cap(4, [(True, 4)]) == 4  # on the prior
    for accepted in [4] * 1000 + [0] * 3000:  # a round each; then copied text stopped matching
        planner.cap(4, [(True, 4)])
        planner.learn(True, 4, 4, accepted)
    assert planner.acceptance(True, 4, 1) < 0.02 and planner.cap(4, [(True, 4)]) == 0
    planner.rounds += 10 * CHAIN_MEMORY  # rounds in which no chain found 4 long was verified
    assert planner.acceptance(True, 4, 1) > 0.45 and planner.cap(4, [(True, 4)]) == 4  # offered again


def test_chain_planner_verifies_whole_chains_where_it_cannot_price_them():
    costs = ForwardCosts(0.1)
    costs.add(4, 1, 1.0)
    assert ChainPlanner(costs.between_widths).cap(4, [(True, 5), (True, 3)]) == 5  # width 6 unmeasured
    costs.add(4, 17, 100.0)  # widths between are interpolated: width 6 costs about 32x a plain forward
    assert costs.between_widths(4, 9) == pytest.approx(1.0 + 99.0 * 8 / 16)
    assert ChainPlanner(costs.between_widths).cap(4, [(True, 5), (True, 3)]) == 0
