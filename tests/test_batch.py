"""Batched rounds (decode/batch.py, decode/round.py) are lossless: every sequence's output equals its
solo run, in float64, for draft trees, chains and plain rows mixed in one forward, sequences that
finish at different times and sequences that join mid-way; seeded sampling draws the same tokens;
each slot's committed KV rows equal a solo DynamicCache; a wrong mask or wrong positions is caught."""

from __future__ import annotations

import functools

import pytest
import torch

from anchorspec.decode import round as round_mod
from anchorspec.decode.batch import BatchKV, batch_allowed, batch_forward, batch_position_ids, one_offs
from anchorspec.decode.engine import (GenerationConfig, PlainDecoding, SpeculativeDecoding, full_attention,
                                      generate_vanilla)
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import DraftTree, TreeShape, tree_attention_mask, tree_position_ids
from anchorspec.errors import AnchorspecError
from batch_world import LENGTHS, MIX, build, make_prompts, run_batched, speculate_flag
from helpers import FAMILIES, OracleProposer, VOCAB, random_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def run_solo(decs, pattern=lambda r: True):
    out = []
    for d in decs:
        rnd = 0
        while not d.finished:
            flag = speculate_flag(d, rnd, pattern)
            d.step() if flag is None else d.step(flag)
            rnd += 1
        out.append(d.result())
    return out


@pytest.mark.parametrize("family, seed, kv_size", [("llama", 0, (4, 256)), ("llama", 1, (1, 4)),
                                                   ("qwen2", 0, (1, 4)), ("qwen2", 2, (4, 256))])
def test_batched_rounds_match_solo_greedy(family, seed, kv_size):
    """Six sequences (oracle and random drafters, trees, chains, one plain), three at a time, joining
    and finishing at different rounds; a tiny BatchKV forces slot and capacity growth."""
    target = tiny_target(family, seed=seed)
    drafter = random_drafter(target, seed=seed + 1)
    prompts = make_prompts(LENGTHS, seed)
    cfgs = [GenerationConfig(max_new_tokens=n) for _, _, n in MIX]
    refs = [generate_vanilla(target, p, c).token_ids for p, c in zip(prompts, cfgs)]
    solo = run_solo([build(target, drafter, k, s, p, c) for (k, s, _), p, c in zip(MIX, prompts, cfgs)])
    decoder = BatchDecoder(target, BatchKV(*kv_size))
    rows_seen = []
    batched = run_batched(decoder, [build(target, drafter, k, s, p, c) for (k, s, _), p, c in zip(MIX, prompts, cfgs)],
                          every_round=lambda r, live: rows_seen.append(r.rows))
    for i, (res, ref, alone) in enumerate(zip(batched, refs, solo)):
        assert res.token_ids == ref, i
        assert len(ref) == cfgs[i].max_new_tokens
        # the same steps: same drafts, same acceptance, same forwards
        for name in ("drafted_tokens", "accepted_tokens", "verify_steps", "target_forwards"):
            assert getattr(res.stats, name) == getattr(alone.stats, name), (i, name)
    assert max(rows_seen) >= 3  # really batched
    assert sum(res.stats.accepted_tokens for res in batched) > 0


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "qwen2")])
def test_batched_rounds_other_families(family):
    target = tiny_target(family)
    drafter = random_drafter(target)
    mix = MIX[:4]
    prompts = make_prompts(LENGTHS[:4], 3)
    cfgs = [GenerationConfig(max_new_tokens=n) for _, _, n in mix]
    refs = [generate_vanilla(target, p, c).token_ids for p, c in zip(prompts, cfgs)]
    batched = run_batched(BatchDecoder(target), [build(target, drafter, k, s, p, c)
                                                 for (k, s, _), p, c in zip(mix, prompts, cfgs)], start=4)
    assert [r.token_ids for r in batched] == refs


def test_speculation_toggled_per_round_stays_lossless():
    """The drift monitor's on/off per request: plain 1-token rows next to trees in the same forward."""
    target = tiny_target("llama")
    drafter = random_drafter(target)
    pattern = lambda r: r % 3 != 1  # noqa: E731
    prompts = make_prompts([5, 12, 7], 4)
    cfg = GenerationConfig(max_new_tokens=17)
    mix = [("oracle", TreeShape(3, 3, 8)), ("random", TreeShape.chain(3)), ("oracle", TreeShape.chain(2))]
    refs = [generate_vanilla(target, p, cfg).token_ids for p in prompts]
    solo = run_solo([build(target, drafter, k, s, p, cfg) for (k, s), p in zip(mix, prompts)], pattern)
    widths = []
    decs = [build(target, drafter, k, s, p, cfg) for (k, s), p in zip(mix, prompts)]
    batched = run_batched(BatchDecoder(target), decs, pattern=pattern,
                          every_round=lambda r, live: widths.append((r.rows, r.width, r.tokens)))
    assert [r.token_ids for r in batched] == refs
    assert [r.stats.verify_steps for r in batched] == [r.stats.verify_steps for r in solo]
    assert any(rows == 3 and tokens < rows * width for rows, width, tokens in widths)  # padded rows ran


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_split_rounds_run_plain_rows_apart_and_stay_lossless(family):
    """`split`: the plain rows' 1-node trees get a forward of their own, apart from the speculating rows'
    trees (the server's cheap probes). Rows switched on and off per row and per round, in float64:
    every output equals plain greedy, every sequence takes its solo steps, and each mixed round ran
    exactly two forwards, one of width 1."""
    target = tiny_target(family, seed=2)
    drafter = random_drafter(target, seed=3)
    prompts = make_prompts([6, 13, 4, 9], 7)
    cfg = GenerationConfig(max_new_tokens=15)
    mix = [("oracle", TreeShape(3, 3, 8)), ("random", TreeShape.chain(3)), ("oracle", TreeShape.chain(2)),
           ("plain", None)]
    flag = lambda i, r: (r + i) % 3 != 0  # noqa: E731 - per row and round, so rounds mix both kinds
    refs = [generate_vanilla(target, p, cfg).token_ids for p in prompts]
    solo = [build(target, drafter, k, s, p, cfg) for (k, s), p in zip(mix, prompts)]
    for i, d in enumerate(solo):
        r = 0
        while not d.finished:
            d.step() if isinstance(d, PlainDecoding) else d.step(flag(i, r))
            r += 1
    decoder = BatchDecoder(target)
    decs = [build(target, drafter, k, s, p, cfg) for (k, s), p in zip(mix, prompts)]
    r, mixed = 0, 0
    while any(not d.finished for d in decs):
        live = [(i, d) for i, d in enumerate(decs) if not d.finished]
        items = [(d, None if isinstance(d, PlainDecoding) else flag(i, r)) for i, d in live]
        result = decoder.round(items, split=True)
        assert not any(isinstance(report, BaseException) for report in result.reports)
        if r and len({bool(s) for _, s in items}) == 2:  # after the prefill round: plain and speculating rows
            mixed += 1
            plain_rows = sum(1 for _, s in items if not s)
            # (a speculating row with one token left to go offers a 1-node tree too: it joins the plain forward)
            assert len(result.forwards) == 2 and [f[0] >= plain_rows for f in result.forwards if f[1] == 1] == [True]
            assert result.rows == len(items) and result.forward_s == pytest.approx(sum(f[2] for f in result.forwards))
        r += 1
    assert mixed >= 3
    assert [d.result().token_ids for d in decs] == refs
    for alone, batched in zip(solo, decs):
        for name in ("drafted_tokens", "accepted_tokens", "verify_steps", "target_forwards"):
            assert getattr(batched.result().stats, name) == getattr(alone.result().stats, name), name
    assert sum(d.result().stats.accepted_tokens for d in decs) > 0


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=str)
@pytest.mark.parametrize("seed", [0, 5])
def test_seeded_sampling_batched_equals_solo(shape, seed):
    target = tiny_target("llama", peaked=1.0)
    drafter = random_drafter(target)
    prompts = make_prompts([4, 13, 9, 6], seed)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    cfgs = [GenerationConfig(max_new_tokens=n, sampling=params, seed=seed * 10 + i)
            for i, n in enumerate([15, 9, 20, 12])]

    def decs():
        out = [SpeculativeDecoding(target, EagleProposer(drafter), p, c, shape) for p, c in zip(prompts[:3], cfgs)]
        return out + [PlainDecoding(target, prompts[3], cfgs[3])]

    solo = run_solo(decs())
    batched = run_batched(BatchDecoder(target), decs(), start=2)
    assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
    assert [r.stats.accepted_tokens for r in batched] == [r.stats.accepted_tokens for r in solo]
    assert len({tuple(r.token_ids[:8]) for r in solo[:3]}) > 1  # really sampled, not one fixed output


def committed_rows(slot):
    """Per layer, the committed [kv_heads, length, head_dim] keys and values of a solo sequence's
    slot (rows past its length are scratch)."""
    kv = slot.kv
    return ([k[slot.index, :, :slot.length] for k in kv.keys], [v[slot.index, :, :slot.length] for v in kv.values])


def test_commit_keeps_exactly_the_accepted_rows():
    """After every round, each slot's committed rows equal the solo run's rows of the same sequence
    (oracle trees accept non-contiguous tree rows; a release moves the last slot into a hole)."""
    target = tiny_target("qwen2")
    drafter = random_drafter(target)
    prompts = make_prompts([6, 14, 3, 9], 7)
    specs = [("oracle", TreeShape(3, 4, 12), 13), ("random", TreeShape(4, 3, 12), 21),
             ("oracle", TreeShape(4, 3, 16), 30), ("plain", None, 17)]
    make = lambda: [build(target, drafter, k, s, p, GenerationConfig(max_new_tokens=n))  # noqa: E731
                    for (k, s, n), p in zip(specs, prompts)]
    solo, batch = make(), make()
    decoder = BatchDecoder(target)
    moved_paths = 0
    while any(not d.finished for d in batch):
        live = [i for i, d in enumerate(batch) if not d.finished]
        for i in live:
            solo[i].step()
        result = decoder.round([(batch[i], None if specs[i][0] == "plain" else True) for i in live])
        assert not any(isinstance(r, BaseException) for r in result.reports)
        for i in live:
            assert batch[i].committed == solo[i].committed
            assert batch[i].out.tokens == solo[i].out.tokens
            if batch[i].finished:
                assert batch[i].cache.released
                continue
            slot = batch[i].cache
            assert slot.length == solo[i].committed
            ref_keys, ref_values = committed_rows(solo[i].cache)
            assert len(ref_keys) == len(decoder.kv.keys)
            for layer, (k, v) in enumerate(zip(ref_keys, ref_values)):
                assert k.shape[1] == slot.length
                torch.testing.assert_close(decoder.kv.keys[layer][slot.index, :, :slot.length], k, rtol=0, atol=1e-12)
                torch.testing.assert_close(decoder.kv.values[layer][slot.index, :, :slot.length], v, rtol=0, atol=1e-12)
        moved_paths += sum(1 for r in result.reports if getattr(r, "accepted", 0) >= 2)
    assert moved_paths > 0


def solo_tree_forward(target, prompt, tree):
    cache = target.new_cache()
    target.forward(prompt, torch.arange(prompt.numel()), cache)
    past = prompt.numel()
    return target.forward(tree.tokens, tree_position_ids(tree, past), cache,
                          attention_mask=tree_attention_mask(tree, past, target.dtype), capture_aux=True)


def trees_and_prompts():
    prompts = make_prompts([5, 11, 2], 9)
    trees = [DraftTree(torch.tensor([3, 4, 5, 6, 7, 8]), [-1, 0, 0, 1, 1, 3]),
             DraftTree(torch.tensor([9]), [-1]),
             DraftTree(torch.tensor([1, 2, 3]), [-1, 0, 1])]
    return prompts, trees


def prefilled(kv, target, prompt):
    """A new slot of `kv` holding `prompt`'s rows (a prefill: one row, a chain)."""
    slot = kv.attach_target(target)
    batch_forward(target, [slot], [DraftTree.chain(prompt)], capture_aux=False)
    slot.commit(0, list(range(prompt.numel())))
    return slot


def attached(target, prompts):
    kv = BatchKV(slots=1, capacity=2)
    return kv, [prefilled(kv, target, p) for p in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batch_forward_equals_solo_tree_forward(family):
    """Per row: logits and captured aux features of the padded batch == the solo tree forward."""
    target = tiny_target(family)
    prompts, trees = trees_and_prompts()
    kv, slots = attached(target, prompts)
    out = batch_forward(target, slots, trees)
    assert out.width == 6 and out.tokens == 10
    for p, tree, logits, aux in zip(prompts, trees, out.logits, out.aux):
        ref = solo_tree_forward(target, p, tree)
        assert logits.shape == ref.logits.shape and aux.shape == ref.aux.shape
        torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(aux, ref.aux, rtol=0, atol=1e-10)
    # the same through a non-dense slot subset (gathered, not a view), in another order
    sub = batch_forward(target, [slots[2], slots[0]], [trees[2], trees[0]])
    torch.testing.assert_close(sub.logits[0], out.logits[2], rtol=0, atol=1e-10)
    torch.testing.assert_close(sub.logits[1], out.logits[0], rtol=0, atol=1e-10)


def test_rows_out_of_slot_order_read_the_cache_through_views(monkeypatch):
    """A round's rows in any order (releases shuffle slots) run in slot order: every layer's cache is
    a view of the buffers, no row is gathered, and each result still goes back to its own row."""
    from anchorspec.decode import batch as batch_mod

    target = tiny_target("llama")
    prompts, trees = trees_and_prompts()
    kv, slots = attached(target, prompts)
    in_order = batch_forward(target, slots, trees)
    caches = []
    real = batch_mod.ForwardCache
    monkeypatch.setattr(batch_mod, "ForwardCache", lambda *a, **k: caches.append(real(*a, **k)) or caches[-1])
    shuffled = [2, 0, 1]
    out = batch_forward(target, [slots[b] for b in shuffled], [trees[b] for b in shuffled])
    assert [c.consecutive for c in caches] == [True]
    for k, b in enumerate(shuffled):
        torch.testing.assert_close(out.logits[k], in_order.logits[b], rtol=0, atol=1e-10)
        torch.testing.assert_close(out.aux[k], in_order.aux[b], rtol=0, atol=1e-10)
    # negative control: the same rows handed to the cache unsorted would be gathered
    assert not real(kv, [slots[b].index for b in shuffled], [0, 0, 0], 1, 4).consecutive


def test_batch_mask_and_positions_are_the_solo_ones():
    _, trees = trees_and_prompts()
    past = [5, 11, 2]
    allowed = batch_allowed(trees, past, 6, 17)
    pos = batch_position_ids(trees, past, 6)
    for b, (tree, p) in enumerate(zip(trees, past)):
        n = tree.size
        solo = tree_attention_mask(tree, p, torch.float64)[0, 0] == 0
        assert torch.equal(allowed[b, :n, :p + n], solo)
        assert not allowed[b, :n, p + n:].any()  # no padding, scratch or other rows' keys
        assert torch.equal(pos[b, :n], tree_position_ids(tree, p))
        for j in range(n, 6):  # padding queries see themselves only
            assert allowed[b, j].nonzero().flatten().tolist() == [p + j]


# --- negative controls: the checks above can fail --------------------------------------------------

def wrong_allowed_sees_siblings(trees, past_lens, width, kv_len):
    allowed = batch_allowed(trees, past_lens, width, kv_len)
    for b, (tree, p) in enumerate(zip(trees, past_lens)):
        allowed[b, :tree.size, p:p + tree.size] = True  # every new row, not just ancestors
    return allowed


def wrong_positions(trees, past_lens, width):
    return batch_position_ids(trees, past_lens, width).roll(1, dims=0)  # row b gets row b-1's positions


@pytest.mark.parametrize("broken", [{"allowed_fn": wrong_allowed_sees_siblings}, {"positions_fn": wrong_positions}],
                         ids=["mask", "positions"])
def test_negative_control_wrong_mask_or_positions_is_caught(broken):
    """The per-row comparison (atol 1e-10 above) is far from passing with either bug."""
    target = tiny_target("llama")
    prompts, trees = trees_and_prompts()
    kv, slots = attached(target, prompts)
    out = batch_forward(target, slots, trees, **broken)
    worst = max((logits - solo_tree_forward(target, p, t).logits).abs().max()
                for p, t, logits in zip(prompts, trees, out.logits))
    assert worst > 1e-4


def test_negative_control_wrong_mask_breaks_lossless_rounds(monkeypatch):
    """End to end, the greedy comparison of test_batched_rounds_match_solo_greedy fails with tree rows
    that see their siblings. (The tiny random targets attend almost uniformly, so a position bug
    barely moves their argmax: the per-row logit comparison above is what catches that one.)"""
    target = tiny_target("llama")
    monkeypatch.setattr(round_mod, "batch_forward", functools.partial(batch_forward,
                                                                      allowed_fn=wrong_allowed_sees_siblings))
    prompts = make_prompts([4, 9, 6], 0)
    cfg = GenerationConfig(max_new_tokens=16)
    refs = [generate_vanilla(target, p, cfg).token_ids for p in prompts]
    decs = [SpeculativeDecoding(target, OracleProposer(target), p, cfg, TreeShape(3, 3, 8)) for p in prompts]
    assert [r.token_ids for r in run_batched(BatchDecoder(target), decs)] != refs


# --- failures stay with their sequence; misuse is refused -------------------------------------------

class FailingProposer(OracleProposer):
    def __init__(self, target, after, bad_token=False):
        super().__init__(target)
        self.calls, self.after, self.bad_token = 0, after, bad_token

    def propose(self, shape, params, generator):
        self.calls += 1
        tree = super().propose(shape, params, generator)
        if self.calls > self.after:
            if not self.bad_token:
                raise RuntimeError("drafter exploded")
            tree.tokens[1] = VOCAB + 5  # out of the embedding: breaks the batched forward itself
        return tree


@pytest.mark.parametrize("bad_token", [False, True], ids=["in_draft", "in_forward"])
def test_one_failing_sequence_does_not_stop_the_others(bad_token):
    target = tiny_target("llama")
    prompts = make_prompts([5, 8, 3], 1)
    cfg = GenerationConfig(max_new_tokens=15)
    refs = [generate_vanilla(target, p, cfg).token_ids for p in prompts]
    shape = TreeShape(3, 3, 8)
    decs = [SpeculativeDecoding(target, OracleProposer(target), prompts[0], cfg, shape),
            SpeculativeDecoding(target, FailingProposer(target, 2, bad_token), prompts[1], cfg, shape),
            PlainDecoding(target, prompts[2], cfg)]
    decoder = BatchDecoder(target)
    live, failed, isolated = list(decs), [], False
    while live:
        result = decoder.round([(d, None if isinstance(d, PlainDecoding) else True) for d in live])
        isolated |= bool(result.isolated)
        for d, r in zip(list(live), result.reports):
            if isinstance(r, BaseException):
                failed.append((d, r))
                live.remove(d)
            elif d.finished:
                live.remove(d)
    assert [d for d, _ in failed] == [decs[1]]
    assert decs[1].cache.released and not decoder.kv.slots
    assert isolated is bad_token
    assert decs[0].result().token_ids == refs[0] and decs[2].result().token_ids == refs[2]


def test_misuse_is_refused():
    target = tiny_target("llama")
    prompt = make_prompts([4], 0)[0]
    dec = SpeculativeDecoding(target, OracleProposer(target), prompt, GenerationConfig(max_new_tokens=8),
                              TreeShape.chain(2))
    with pytest.raises(AnchorspecError, match="prefill first"):
        dec.prepare()
    dec.step()
    with pytest.raises(AnchorspecError, match="without prepare"):
        dec.finish(torch.zeros(1, VOCAB), None, 0.0)
    dec.prepare()
    with pytest.raises(AnchorspecError, match="pending"):
        dec.prepare()
    with pytest.raises(AnchorspecError, match="pending"):
        dec.step()

    kv, (slot,) = attached(target, [prompt])
    with pytest.raises(AnchorspecError, match="committed rows"):
        slot.commit(slot.length + 1, [0])
    other = make_prompts([3], 1)[0]
    plain = PlainDecoding(target, other, GenerationConfig(max_new_tokens=4))
    plain.step()
    with pytest.raises(AnchorspecError, match="rows"):
        plain.use_slot(slot)  # 4 rows in the slot, 3 in the sequence
    plain.use_slot(prefilled(kv, target, other))
    with pytest.raises(AnchorspecError, match="attached to a batch"):
        plain.step()
    slot.release()
    with pytest.raises(AnchorspecError, match="released"):
        slot.commit(slot.length, [0])
    with pytest.raises(AnchorspecError, match="one tree per slot"):
        batch_forward(target, [plain.cache], [])


def test_sliding_window_cache_keeps_stepping_alone():
    """A cache with sliding-window layers cannot move into a slot: that sequence is stepped alone in
    each round (as before batching), next to batched ones, and both stay exact."""
    sliding = tiny_target("mistral")
    sliding.model.config.sliding_window = 8
    assert not full_attention(sliding) and full_attention(tiny_target("llama"))
    full = tiny_target("llama")
    prompts = make_prompts([12, 5], 2)
    cfg = GenerationConfig(max_new_tokens=15)
    refs = [generate_vanilla(sliding, prompts[0], cfg).token_ids, generate_vanilla(full, prompts[1], cfg).token_ids]
    decs = [PlainDecoding(sliding, prompts[0], cfg), PlainDecoding(full, prompts[1], cfg)]
    decoder = BatchDecoder(full)
    solo_steps = 0
    while not all(d.finished for d in decs):
        live = [d for d in decs if not d.finished]
        result = decoder.round([(d, None) for d in live])
        assert not any(isinstance(r, BaseException) for r in result.reports)
        solo_steps += result.solo
    assert [d.result().token_ids for d in decs] == refs
    assert not decs[0].batched and solo_steps == 14  # every step after the prefill


def test_a_round_that_grows_the_cache_says_so():
    """RoundResult.one_off is set exactly in the rounds during which a KV buffer was reallocated (batch.one_offs):
    such a round's time is no sample of what rounds cost (the server's monitor skips it)."""
    target = tiny_target("llama")
    decoder = BatchDecoder(target, BatchKV(slots=1, capacity=4))
    decs = [PlainDecoding(target, p, GenerationConfig(max_new_tokens=12)) for p in make_prompts([3, 5], 0)]
    flags = []
    while any(not d.finished for d in decs):
        before = one_offs()
        result = decoder.round([(d, None) for d in decs if not d.finished])
        flags.append((result.one_off, one_offs() != before))
    assert all(flag == grew for flag, grew in flags)
    assert any(flag for flag, _ in flags) and not all(flag for flag, _ in flags)
