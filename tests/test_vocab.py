"""Draft vocabulary selection and d2t/t2d mapping (eagle31-spec.md §4; peers-and-tests.md item 21)."""

from __future__ import annotations

import pytest
import torch
import transformers

from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import init_drafter
from anchorspec.train.vocab import count_loss_tokens, coverage, select_draft_vocab, vocab_mapping

V, VD = 96, 16


def _random_batches(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # skewed distribution so there is a clear top-k plus plenty of ties at the tail
        ids = (torch.rand(3, 40, generator=g) ** 3 * V).long()
        mask = (torch.rand(3, 40, generator=g) < 0.6).long()
        out.append((ids, mask))
    return out


def _check_invariants(d2t, t2d, vd, v):
    assert d2t.dtype == torch.long and d2t.shape == (vd,)
    assert t2d.dtype == torch.bool and t2d.shape == (v,)
    ids = torch.arange(vd) + d2t
    assert bool(t2d[ids].all())
    assert int(t2d.sum()) == vd
    assert torch.equal(ids, ids.unique())  # sorted ascending and unique
    assert bool((ids[1:] > ids[:-1]).all())


# --- counting ------------------------------------------------------------------------------------------

def test_count_only_loss_masked_positions():
    ids = [[1, 2, 2, 3], [3, 3, 5, 0]]
    mask = [[1, 0, 1, 1], [0, 1, 1, 0]]
    c = count_loss_tokens([(ids, mask)], 6)
    assert c.dtype == torch.long
    assert c.tolist() == [0, 1, 1, 2, 0, 1]


def test_count_accepts_1d_2d_lists_tensors_and_bool_masks():
    batches = [([4, 4, 1], [1, 1, 0]), (torch.tensor([[1, 4]]), torch.tensor([[True, False]]))]
    assert count_loss_tokens(batches, 5).tolist() == [0, 1, 0, 0, 2]
    assert count_loss_tokens(iter(batches), 5).tolist() == [0, 1, 0, 0, 2]  # any iterable, e.g. a generator


def test_masked_out_tokens_never_change_the_choice():
    # loss-masked: ids 10, 11, 12 frequent; unmasked (prompt): id 50 hugely frequent.
    ids = [10] * 5 + [11] * 4 + [12] * 3 + [13] + [50] * 100
    mask = [1] * 13 + [0] * 100
    counts = count_loss_tokens([(ids, mask)], V)
    assert int(counts[50]) == 0
    assert select_draft_vocab(counts, 3).tolist() == [10, 11, 12]
    # sanity: if the prompt tokens were counted, 50 would be in the top-3 -> the test can tell the difference
    naive = count_loss_tokens([(ids, [1] * len(ids))], V)
    assert 50 in select_draft_vocab(naive, 3).tolist()
    # changing only masked-out tokens leaves counts (and the choice) bit-identical
    ids2 = ids[:13] + [77] * 100
    assert torch.equal(count_loss_tokens([(ids2, mask)], V), counts)


def test_all_zero_mask_counts_nothing_and_pads():
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(1))
    counts = count_loss_tokens([(ids, torch.zeros_like(ids))], V)
    assert int(counts.sum()) == 0
    assert select_draft_vocab(counts, VD).tolist() == list(range(VD))
    with pytest.raises(AnchorspecError, match="no loss-masked tokens"):
        coverage(counts, select_draft_vocab(counts, VD))


def test_all_one_mask_counts_everything():
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    counts = count_loss_tokens([(ids, torch.ones_like(ids))], V)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=V))
    assert int(counts.sum()) == 60


def test_empty_input():
    assert count_loss_tokens([], 7).tolist() == [0] * 7
    assert count_loss_tokens([([], [])], 7).tolist() == [0] * 7


# --- selection -----------------------------------------------------------------------------------------

def test_top_k_and_tie_break_by_lower_id():
    counts = torch.tensor([0, 5, 3, 5, 3, 3, 9, 0])
    # 6 (9), then 1 and 3 (5 each), then the tie at 3 among 2, 4, 5 -> lowest ids first
    assert select_draft_vocab(counts, 4).tolist() == [1, 2, 3, 6]
    assert select_draft_vocab(counts, 5).tolist() == [1, 2, 3, 4, 6]
    # reversing the id order of the tie changes nothing about the rule: lower id wins
    assert select_draft_vocab(torch.tensor([3, 3, 3, 9]), 2).tolist() == [0, 3]


def test_determinism_bit_identical():
    b = _random_batches()
    c1, c2 = count_loss_tokens(b, V), count_loss_tokens(_random_batches(), V)
    assert torch.equal(c1, c2)
    s1, s2 = select_draft_vocab(c1, VD, always_include=[95]), select_draft_vocab(c2.clone(), VD, always_include=[95])
    assert s1.dtype == torch.long and torch.equal(s1, s2)
    m1, m2 = vocab_mapping(s1, V), vocab_mapping(s2, V)
    assert torch.equal(m1[0], m2[0]) and torch.equal(m1[1], m2[1])
    # float counts with ties give the same answer as int counts
    assert torch.equal(select_draft_vocab(c1.double(), VD), select_draft_vocab(c1, VD))


def test_always_include_displaces_least_frequent():
    counts = torch.tensor([10, 9, 8, 7, 6, 0, 0, 0])
    assert select_draft_vocab(counts, 4).tolist() == [0, 1, 2, 3]
    got = select_draft_vocab(counts, 4, always_include=[7])
    assert got.tolist() == [0, 1, 2, 7]  # 3 (least frequent of the top-4) is displaced
    # already-selected forced ids displace nothing; duplicates are ignored; tensors accepted
    assert select_draft_vocab(counts, 4, always_include=torch.tensor([1, 1])).tolist() == [0, 1, 2, 3]
    # forcing the whole draft vocab
    assert select_draft_vocab(counts, 2, always_include=(6, 5)).tolist() == [5, 6]


def test_padding_with_lowest_unused_ids():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 11, 17]] = torch.tensor([4, 2, 1])
    assert select_draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 11, 17]
    assert select_draft_vocab(counts, 6, always_include=[19]).tolist() == [0, 1, 3, 11, 17, 19]
    assert select_draft_vocab(counts, 20).tolist() == list(range(20))


# --- mapping -------------------------------------------------------------------------------------------

def test_mapping_invariants_on_random_data():
    counts = count_loss_tokens(_random_batches(3), V)
    ids = select_draft_vocab(counts, VD, always_include=[0, 95])
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == VD and {0, 95} <= set(ids.tolist())
    d2t, t2d = vocab_mapping(ids, V)
    _check_invariants(d2t, t2d, VD, V)
    assert torch.equal(torch.arange(VD) + d2t, ids)
    assert t2d.nonzero().view(-1).tolist() == ids.tolist()


def test_mapping_hand_example_and_order_independence():
    d2t, t2d = vocab_mapping(torch.tensor([7, 2, 5]), 8)
    assert d2t.tolist() == [2, 4, 5]  # used = [2, 5, 7] -> [2-0, 5-1, 7-2]
    assert t2d.tolist() == [False, False, True, False, False, True, False, True]
    _check_invariants(d2t, t2d, 3, 8)
    # full vocabulary -> zero offsets, all-true mask
    d2t, t2d = vocab_mapping(torch.arange(8), 8)
    assert d2t.tolist() == [0] * 8 and bool(t2d.all())


def test_round_trip_through_drafter_set_vocab_mapping():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)
    drafter = init_drafter(cfg, draft_vocab_size=VD)
    counts = count_loss_tokens(_random_batches(5), V)
    ids = select_draft_vocab(counts, VD, always_include=[94])
    assert not torch.equal(ids, torch.arange(VD))  # a non-trivial mapping, else the round trip is vacuous
    d2t, t2d = vocab_mapping(ids, V)
    drafter.set_vocab_mapping(ids[torch.randperm(VD, generator=torch.Generator().manual_seed(0))])
    assert drafter.d2t.dtype == d2t.dtype and torch.equal(drafter.d2t, d2t)
    assert drafter.t2d.dtype == t2d.dtype and torch.equal(drafter.t2d, t2d)
    assert torch.equal(drafter.draft_to_target, ids)


# --- coverage ------------------------------------------------------------------------------------------

def test_coverage_hand_example():
    counts = torch.tensor([5, 0, 3, 2])  # 10 loss-masked occurrences
    assert coverage(counts, torch.tensor([0, 2])) == pytest.approx(0.8)
    assert coverage(counts, [3]) == pytest.approx(0.2)
    assert coverage(counts, [1]) == 0.0
    assert coverage(counts, torch.arange(4)) == 1.0
    assert isinstance(coverage(counts, [0]), float)


def test_coverage_of_selected_vocab_is_monotone():
    counts = count_loss_tokens(_random_batches(7), V)
    covs = [coverage(counts, select_draft_vocab(counts, k)) for k in (1, 4, 16, 48, V)]
    assert all(a <= b for a, b in zip(covs, covs[1:]))
    assert covs[-1] == 1.0 and 0 < covs[0] < 1


# --- errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batches, match", [
    ([([1, 2, 6], [1, 1, 1])], r"token id 6 outside the vocabulary 0\.\.5"),
    ([([1, -1], [0, 0])], r"token id -1 outside"),  # rejected even where masked out
    ([([1, 2, 3], [1, 1])], r"loss_mask shape \(2,\) != input_ids shape \(3,\)"),
    ([(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2))], r"\(3, 2\) != input_ids shape \(2, 3\)"),
    ([(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3))], r"1-D or 2-D, got shape \(1, 2, 3\)"),
    ([([1.0, 2.0], [1, 1])], r"integers, got dtype torch.float32"),
    ([([1, 2], [1, 2])], r"loss_mask must be 0/1, found value 2"),
    ([[1, 2, 3]], r"batch 0: expected an \(input_ids, loss_mask\) pair"),
])
def test_count_errors(batches, match):
    with pytest.raises(AnchorspecError, match=match):
        count_loss_tokens(batches, 6)


def test_count_error_names_batch_and_vocab_size():
    with pytest.raises(AnchorspecError, match=r"batch 1: token id 9"):
        count_loss_tokens([([0], [1]), ([9], [1])], 6)
    with pytest.raises(AnchorspecError, match=r"vocab_size=0"):
        count_loss_tokens([], 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft_vocab_size=0), r"draft_vocab_size=0 must be in 1\.\.vocab_size=8"),
    (dict(draft_vocab_size=9), r"draft_vocab_size=9 must be in 1\.\.vocab_size=8"),
    (dict(draft_vocab_size=2, always_include=[0, 1, 2]), r"always_include has 3 ids, more than draft_vocab_size=2"),
    (dict(draft_vocab_size=2, always_include=[8]), r"always_include id 8 outside the vocabulary 0\.\.7"),
    (dict(draft_vocab_size=2, always_include=[-1]), r"always_include id -1 outside"),
])
def test_select_errors(kwargs, match):
    with pytest.raises(AnchorspecError, match=match):
        select_draft_vocab(torch.arange(8), **kwargs)


def test_select_errors_on_bad_counts():
    with pytest.raises(AnchorspecError, match=r"1-D tensor, got shape \(2, 2\)"):
        select_draft_vocab(torch.ones(2, 2), 1)
    with pytest.raises(AnchorspecError, match="non-negative"):
        select_draft_vocab(torch.tensor([1, -1, 2]), 1)
    with pytest.raises(AnchorspecError, match="non-negative"):
        select_draft_vocab(torch.tensor([1.0, float("nan")]), 1)


@pytest.mark.parametrize("ids, match", [
    ([1, 1, 2], r"unique, got 3 ids with 2 distinct"),
    ([0, 8], r"draft id 8 outside the vocabulary 0\.\.7"),
    ([-2, 3], r"draft id -2 outside"),
    ([], r"non-empty 1-D"),
    ([[1, 2]], r"non-empty 1-D tensor, got shape \(1, 2\)"),
    ([0.0, 1.0], r"integers"),
])
def test_mapping_errors(ids, match):
    with pytest.raises(AnchorspecError, match=match):
        vocab_mapping(ids, 8)


def test_coverage_errors():
    with pytest.raises(AnchorspecError, match=r"draft id 4 outside the vocabulary 0\.\.3"):
        coverage(torch.tensor([1, 1, 1, 1]), [4])
    with pytest.raises(AnchorspecError, match=r"unique, got 2 ids with 1 distinct"):
        coverage(torch.tensor([1, 1, 1, 1]), [2, 2])
    with pytest.raises(AnchorspecError, match="non-negative"):
        coverage(torch.tensor([1, -1]), [0])
    with pytest.raises(AnchorspecError, match="no loss-masked tokens"):
        coverage(torch.zeros(4), [0])
