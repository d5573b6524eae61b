"""Batched drafting (decode/drafting.py): the drafter passes of many sequences run in lockstep as
one padded forward per level, and every sequence gets exactly what it would get drafting alone:
the same trees and chains (greedy and seeded sampling), the same drafter outputs and the same
committed drafter KV rows, in float64; wide passes run alone; a failing pass stays with its
sequence; a wrong mask is caught (negative control)."""

from __future__ import annotations

import pytest
import torch

from anchorspec.api import attach_drafter
from anchorspec.decode import drafting
from anchorspec.decode.batch import BatchKV
from anchorspec.decode.drafting import WIDE, run_lockstep, run_program
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from anchorspec.models.drafter import KVCache, init_drafter
from helpers import VOCAB, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [TreeShape(4, 4, 16), TreeShape.chain(3), TreeShape(2, 5, 11), TreeShape.chain(1), TreeShape(3, 2, 7)]
# (2, 5, 11): deep enough sampled too, where two chains of 5 need 10 rows beside the root
# context lengths; two are wider than WIDE: their first passes share a forward of their own
CONTEXTS = [5, 12, WIDE + 9, 3, 20, WIDE + 20]
SHAPES = SHAPES + [TreeShape(2, 3, 6)]


def setup(variant="eagle3.1", seed=0):
    target = tiny_target("llama", seed=seed)
    drafter = init_drafter(target.config, variant, draft_vocab_size=64, seed=seed + 1).to(torch.float64)
    attach_drafter(target, drafter)
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in CONTEXTS:
        tokens = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        aux = target.forward(tokens[:-1], torch.arange(n), target.new_cache(), capture_aux=True).aux
        seqs.append((tokens, aux))
    return target, drafter, seqs


def draft_program(proposer, tokens, aux, shape, params, seed):
    gen = None if params.greedy else torch.Generator().manual_seed(seed)
    yield from proposer.update_passes(tokens, aux)
    return (yield from proposer.propose_passes(shape, params, gen))


def solo_and_batched(drafter, seqs, params, split=0):
    """Per sequence: a draft after the context less its last `split` rows, then (if split) one after
    those rows as a second update; alone (a batch of one on its own slot), and in lockstep on slots
    of one shared BatchKV.
    Returns both sets of proposers, the trees of each draft, and the last Lockstep."""
    solo = [EagleProposer(drafter) for _ in seqs]
    batched = [EagleProposer(drafter) for _ in seqs]
    kv = BatchKV(slots=2, capacity=8)  # small: growth while drafting
    for p in batched:
        p.use_slot(kv.attach_rows(*p.cache_rows()))
    trees_solo, trees_batched = [], []
    updates = [[(t[:len(a) - split + 1], a[:len(a) - split])] + ([(t, a[len(a) - split:])] if split else [])
               for t, a in seqs]
    for part in range(len(updates[0])):
        args = [(u[part][0], u[part][1], shape, params, i) for i, (u, shape) in enumerate(zip(updates, SHAPES))]
        trees_solo.append([run_program(draft_program(p, *a)) for p, a in zip(solo, args)])
        lock = run_lockstep([draft_program(p, *a) for p, a in zip(batched, args)])
        trees_batched.append(lock.results)
    return solo, batched, trees_solo, trees_batched, lock, kv


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_lockstep_drafting_equals_solo_drafting(variant, params):
    target, drafter, seqs = setup(variant)
    solo, batched, trees_solo, trees_batched, lock, kv = solo_and_batched(drafter, seqs, params, split=2)
    for round_solo, round_batched in zip(trees_solo, trees_batched):
        for i, (a, b) in enumerate(zip(round_solo, round_batched)):
            assert not isinstance(b, Exception), b
            assert b.tokens.tolist() == a.tokens.tolist(), i
            assert b.parents == a.parents, i
            if a.draft_probs is not None:  # sampled chains carry q for rejection sampling
                torch.testing.assert_close(b.draft_probs, a.draft_probs, rtol=0, atol=1e-12)
    for i, (a, b) in enumerate(zip(solo, batched)):
        rows = a.cache.length
        assert b.cache.length == rows  # speculative rows were dropped: only the context is committed
        (solo_k,), (solo_v,) = a.cache_rows()
        torch.testing.assert_close(kv.keys[0][b.cache.index, :, :rows], solo_k[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(kv.values[0][b.cache.index, :, :rows], solo_v[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-12)
    # one drafter call per level: the update, then the deepest shape's levels (depth 5 -> 4 more)
    assert lock.levels == 1 + max(s.depth for s in SHAPES) - 1
    assert lock.widest == len(SHAPES)


def test_passes_out_of_slot_order_read_the_drafter_cache_through_views(monkeypatch):
    """Sequences drafting in an order other than their slots' (releases shuffle slots) run in slot
    order: no drafter forward gathers its cache rows, and each gets its own solo draft."""
    _, drafter, seqs = setup()
    seqs = [s for s, n in zip(seqs, CONTEXTS) if n < WIDE]  # one forward per level over all of them
    kv = BatchKV(slots=2, capacity=8)
    solo = [EagleProposer(drafter) for _ in seqs]
    batched = [EagleProposer(drafter) for _ in seqs]
    for p in batched:
        p.use_slot(kv.attach_rows(*p.cache_rows()))
    real, caches = drafting.ForwardCache, []
    monkeypatch.setattr(drafting, "ForwardCache", lambda *a, **k: caches.append(real(*a, **k)) or caches[-1])
    params = SamplingParams()
    args = [(t, a, TreeShape(2, 3, 6), params, i) for i, (t, a) in enumerate(seqs)]
    order = [2, 0, 3, 1]
    lock = run_lockstep([draft_program(batched[i], *args[i]) for i in order])
    assert len(caches) == 3 and all(c.consecutive and c.batch == 4 for c in caches)
    for k, i in enumerate(order):
        want = run_program(draft_program(solo[i], *args[i]))
        assert lock.results[k].tokens.tolist() == want.tokens.tolist() and lock.results[k].parents == want.parents
    # negative control: those rows handed to the cache unsorted would be gathered
    assert not real(kv, [batched[i].cache.index for i in order], [0] * len(order), 1, 4).consecutive


def spy_layer(monkeypatch, drafter) -> list[tuple[int, int]]:
    """Records (sequences, padded width) of every drafter layer call."""
    calls = []
    layer = drafter.layer
    monkeypatch.setattr(drafter, "layer", lambda ids, *a, **k: calls.append(tuple(ids.shape)) or layer(ids, *a, **k))
    return calls


def test_wide_passes_batch_by_size_class(monkeypatch):
    """The first level (context passes of 5..52 tokens) is two forwards: the narrow passes together,
    padded to the widest of them, and the two wide ones (41 and 52 tokens) together."""
    _, drafter, seqs = setup()
    calls = spy_layer(monkeypatch, drafter)
    solo_and_batched(drafter, seqs, SamplingParams())
    assert (4, 20) in calls and (2, WIDE + 20) in calls  # (sequences, padded width)


def test_one_forward_per_level(monkeypatch):
    """The round's drafting is one drafter forward per level over all drafting sequences (the
    prompts' first passes aside: they are wide and run alone)."""
    target, drafter, _ = setup()
    calls = spy_layer(monkeypatch, drafter)
    cfg = GenerationConfig(max_new_tokens=12)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 6, 13)]
    decs = [SpeculativeDecoding(target, EagleProposer(drafter), p, cfg, TreeShape.chain(3)) for p in prompts]
    decoder = BatchDecoder(target)
    decoder.round([(d, True) for d in decs])  # prefills
    calls.clear()
    result = decoder.round([(d, True) for d in decs])  # first drafts: the prompts' context passes
    assert result.draft_passes == 3 and result.draft_rows == 4
    assert calls == [(4, 13), (4, 1), (4, 1)]  # update (padded to the longest prompt), 2 chain steps
    calls.clear()
    result = decoder.round([(d, True) for d in decs])
    assert result.draft_passes == 3 and all(shape[0] == 4 for shape in calls) and len(calls) == 3
    assert [d.result().token_ids if d.finished else None for d in decs] == [None] * 4


def test_batched_generation_equals_plain_greedy_with_many_drafting_sequences():
    """Eight EAGLE sequences with five shapes drafting together stay lossless end to end."""
    target, drafter, _ = setup()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in range(3, 11)]
    cfgs = [GenerationConfig(max_new_tokens=8 + i) for i in range(8)]
    refs = [generate_vanilla(target, p, c).token_ids for p, c in zip(prompts, cfgs)]
    decs = [SpeculativeDecoding(target, EagleProposer(drafter), p, c, SHAPES[i % len(SHAPES)])
            for i, (p, c) in enumerate(zip(prompts, cfgs))]
    decoder = BatchDecoder(target)
    widest = 0
    while not all(d.finished for d in decs):
        result = decoder.round([(d, True) for d in decs if not d.finished])
        assert not any(isinstance(r, BaseException) for r in result.reports)
        widest = max(widest, result.draft_rows)
    assert [d.result().token_ids for d in decs] == refs
    assert widest == 8
    assert not decoder.kv.slots and not any(kv.slots for kv in decoder.draft_kv.values())


def test_negative_control_wrong_drafter_mask_is_caught(monkeypatch):
    """Letting every query see every key (siblings, other levels' branches, padding) must change
    what lockstep drafting returns: the equality above is not vacuous."""
    _, drafter, seqs = setup()
    monkeypatch.setattr(drafting, "padded_allowed", lambda blocks, past, width, kv_len:
                        torch.ones(len(blocks), width, kv_len, dtype=torch.bool))
    solo, batched, trees_solo, trees_batched, _, _ = solo_and_batched(drafter, seqs, SamplingParams())
    differs = sum(not torch.allclose(b.logits, a.logits, rtol=0, atol=1e-9) for a, b in zip(solo, batched))
    differs += sum(a.tokens.tolist() != b.tokens.tolist() for a, b in zip(trees_solo[0], trees_batched[0]))
    assert differs >= 3


def test_a_failing_pass_stays_with_its_sequence():
    """A pass whose features have the wrong width breaks the shared forward; the others are re-run
    alone and still equal their solo drafts."""
    _, drafter, seqs = setup()
    kv = BatchKV()
    proposers = [EagleProposer(drafter) for _ in seqs]
    for p in proposers:
        p.use_slot(kv.attach_rows(*p.cache_rows()))
    bad = 1
    programs = []
    for i, (p, (t, a)) in enumerate(zip(proposers, seqs)):
        a = a[:, :-1] if i == bad else a
        programs.append(draft_program(p, t, a, SHAPES[i], SamplingParams(), i))
    lock = run_lockstep(programs)
    assert isinstance(lock.results[bad], Exception)
    solo = [run_program(draft_program(EagleProposer(drafter), t, a, s, SamplingParams(), 0))
            for (t, a), s in zip(seqs, SHAPES)]
    for i, (a, b) in enumerate(zip(solo, lock.results)):
        if i != bad:
            assert b.tokens.tolist() == a.tokens.tolist() and b.parents == a.parents
    assert proposers[bad].cache.length == 0  # nothing committed for the failed pass


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("layers", [1, 2])
def test_proposer_equals_the_drafters_own_steps_on_a_kv_cache(variant, layers):
    """The proposer drafts through the padded slot forward only (alone, a batch of one); the
    reference is the drafter's own `step` on a growing KVCache (the math TTT trains): a greedy chain
    built step by step from it has the proposer's tokens, and the tree's first level its top-k."""
    target = tiny_target("llama")
    drafter = init_drafter(target.config, variant, draft_vocab_size=64, seed=3, num_layers=layers).to(torch.float64)
    attach_drafter(target, drafter)
    n, k = 9, 4
    tokens = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(1))
    aux = target.forward(tokens[:-1], torch.arange(n), target.new_cache(), capture_aux=True).aux

    with torch.inference_mode():
        cache = KVCache()
        out = drafter.step(tokens[1:][None], drafter.project_features(aux)[None], torch.arange(n)[None], cache)
        context_logits = out.logits[0, -1]
        logits, x, chain = context_logits, out.next_hidden[0, -1:], [int(tokens[-1])]
        for d in range(1, k + 1):
            chain.append(int(drafter.draft_to_target[int(torch.argmax(logits))]))
            if d < k:
                out = drafter.step(torch.tensor([[chain[-1]]]), x[None], torch.tensor([[n + d - 1]]), cache)
                logits, x = out.logits[0, -1], out.next_hidden[0]
    first_level = drafter.draft_to_target[torch.topk(context_logits, 3).indices].tolist()

    proposer = EagleProposer(drafter)
    proposer.update(tokens, aux)
    torch.testing.assert_close(proposer.logits, context_logits, rtol=0, atol=1e-12)
    assert proposer.propose(TreeShape.chain(k), SamplingParams(), None).tokens.tolist() == chain
    tree = proposer.propose(TreeShape(3, 3, 9), SamplingParams(), None)
    assert [t for t, p in zip(tree.tokens.tolist(), tree.parents) if p == 0] == first_level


def test_batched_generation_with_a_two_layer_drafter_equals_plain_greedy():
    """A multi-layer drafter's every layer moves into the shared batch slot (EagleProposer.cache_rows):
    four sequences drafting together with a 2-layer drafter give plain greedy's tokens."""
    target = tiny_target("llama")
    drafter = init_drafter(target.config, "eagle3.1", draft_vocab_size=64, seed=5, num_layers=2).to(torch.float64)
    attach_drafter(target, drafter)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5, 11)]
    cfg = GenerationConfig(max_new_tokens=10)
    refs = [generate_vanilla(target, p, cfg).token_ids for p in prompts]
    decs = [SpeculativeDecoding(target, EagleProposer(drafter), p, cfg, SHAPES[i]) for i, p in enumerate(prompts)]
    decoder = BatchDecoder(target)
    while not all(d.finished for d in decs):
        result = decoder.round([(d, True) for d in decs if not d.finished])
        assert not any(isinstance(r, BaseException) for r in result.reports), result.reports
    assert [d.result().token_ids for d in decs] == refs
    assert sum(d.stats.drafted_tokens for d in decs) > 0
