"""Tests for turning logits into the sampled distribution: temperature, top-k, top-p, pick_token,
and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from anchorspec.decode.sampling import NUCLEUS_HEAD, SamplingParams, nucleus, pick_token, probs_from_logits
from anchorspec.errors import AnchorspecError

V = 10


def rand_logits(*shape, seed=0, dtype=torch.float64) -> torch.Tensor:
    # continuous random values: no ties, so "the k largest" is well defined
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def reference(row: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python statement of the rule: softmax(logits / T), keep the k largest, renormalize, then
    keep tokens in descending order until their mass reaches top_p, renormalize."""
    scaled = [x / temperature for x in row]
    order = sorted(range(len(row)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k else order
    m = max(scaled)
    w = {i: math.exp(scaled[i] - m) for i in keep}
    probs = {i: w[i] / sum(w.values()) for i in keep}
    if top_p < 1:
        kept, mass = [], 0.0
        for i in keep:  # `keep` is already in descending order
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        probs = {i: probs[i] / mass for i in kept}
    return [probs.get(i, 0.0) for i in range(len(row))]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_softmax(temperature):
    logits = rand_logits(4, V)
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_temperature_sharpens_and_flattens():
    logits = rand_logits(V)
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    hot = probs_from_logits(logits, SamplingParams(temperature=2.0))
    assert cold.max() > torch.softmax(logits, -1).max() > hot.max()


@pytest.mark.parametrize("k", [1, 3, 5, V - 1])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = rand_logits(6, V, seed=1)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.3, top_k=k))
    top = torch.topk(logits, k, dim=-1).indices
    for row in range(logits.shape[0]):
        kept = set(torch.nonzero(probs[row]).flatten().tolist())
        assert kept == set(top[row].tolist())
        # the kept tokens keep their relative weights: softmax over the kept logits only
        idx = top[row]
        torch.testing.assert_close(probs[row, idx], torch.softmax(logits[row, idx] / 1.3, dim=-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, dtype=torch.float64))


@pytest.mark.parametrize("k", [0, V, V + 5])
def test_top_k_off_or_at_least_vocab_is_a_no_op(k):
    logits = rand_logits(3, V, seed=2)
    torch.testing.assert_close(
        probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k)), torch.softmax(logits, dim=-1)
    )


# p = [0.05, 0.40, 0.10, 0.30, 0.15]: descending 0.40 (tok 1), 0.30 (tok 3), 0.15 (tok 4), 0.10, 0.05
@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.01, {1}),  # the first token is always kept, even if it alone exceeds top_p
        (0.35, {1}),
        (0.6, {1, 3}),  # 0.40 < 0.6, 0.70 >= 0.6: smallest prefix reaching top_p
        (0.75, {1, 3, 4}),
        (0.9, {1, 3, 4, 2}),
        (0.99, {0, 1, 2, 3, 4}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    p = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15], dtype=torch.float64)
    probs = probs_from_logits(p.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert set(torch.nonzero(probs).flatten().tolist()) == kept
    idx = torch.tensor(sorted(kept))
    torch.testing.assert_close(probs[idx], p[idx] / p[idx].sum())  # renormalized, ratios preserved


@pytest.mark.parametrize("top_p, n_kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7, 3), (0.8, 4)])
def test_top_p_exact_boundary_stops_at_the_prefix_that_reaches_p(top_p, n_kept):
    # four equal logits give probabilities of exactly 0.25 and exact cumulative sums, so a prefix
    # whose mass equals top_p must be the last one kept (">=", not ">")
    probs = probs_from_logits(torch.zeros(4, dtype=torch.float64), SamplingParams(temperature=1.0, top_p=top_p))
    assert int((probs > 0).sum()) == n_kept
    torch.testing.assert_close(probs[probs > 0], torch.full((n_kept,), 1 / n_kept, dtype=torch.float64))


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.5), (0.7, 4, 1.0), (0.7, 4, 0.8), (1.8, 6, 0.3), (0.5, 2, 0.95), (3.0, 0, 0.9)],
)
def test_matches_plain_python_reference(temperature, top_k, top_p):
    logits = rand_logits(8, V, seed=3)
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    expected = torch.tensor([reference(r, temperature, top_k, top_p) for r in logits.tolist()], dtype=torch.float64)
    torch.testing.assert_close(probs, expected)


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The cut by a sort of the whole row (what probs_from_logits did until session 74): the oracle."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
    out = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 0.999999])
def test_nucleus_from_the_head_equals_a_sort_of_the_whole_row(dtype, top_p):
    # a real vocabulary's width, rows from peaked to nearly flat: the flat ones need the head to grow past
    # NUCLEUS_HEAD and past 8x it (checked below), so every branch of the search is compared with the sort
    vocab = 49152
    scale = torch.tensor([12.0, 4.0, 2.0, 1.0, 0.3, 0.05], dtype=torch.float64)[:, None]
    probs = torch.softmax(rand_logits(6, vocab, seed=11) * scale, -1).to(dtype)
    got = nucleus(probs, top_p)
    expected = sorted_nucleus(probs, top_p)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-7)
    if top_p >= 0.9:
        assert int((got[-1] > 0).sum()) > 8 * NUCLEUS_HEAD  # the flattest row's nucleus lay past two heads
    alone = nucleus(probs[-1], top_p)  # one row alone (the plain loop's draw), widened alike
    assert torch.equal(alone > 0, got[-1] > 0)
    torch.testing.assert_close(alone, got[-1], rtol=1e-6, atol=0)
    # a negative control: a head cut without the check that its mass reaches top_p keeps too little
    head, order = probs.topk(NUCLEUS_HEAD, dim=-1)
    truncated = torch.zeros_like(probs).scatter(-1, order, head.masked_fill(head.cumsum(-1) - head >= top_p, 0.0))
    if top_p >= 0.9:
        assert not torch.equal(truncated > 0, expected > 0)


def test_rows_are_independent():
    # rows on very different scales: a bug that sorted, thresholded or normalized across the whole
    # batch (instead of per row) would change the small-scale rows
    logits = rand_logits(5, V, seed=4) * torch.tensor([0.1, 1.0, 10.0, 0.5, 3.0], dtype=torch.float64)[:, None]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7)
    batch = probs_from_logits(logits, params)
    for i in range(5):
        torch.testing.assert_close(batch[i], probs_from_logits(logits[i], params))
    perm = torch.tensor([3, 0, 4, 1, 2])
    torch.testing.assert_close(probs_from_logits(logits[perm], params), batch[perm])


@pytest.mark.parametrize(
    "dtype, out",
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_output_dtype(dtype, out):
    logits = rand_logits(2, V, seed=5, dtype=dtype)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.9, top_k=5, top_p=0.9))
    assert probs.dtype == out
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=out))


def test_float64_precision_is_kept():
    # a difference of 1e-12 in float64 logits survives; it would vanish in float32
    logits = torch.tensor([0.0, 1e-12], dtype=torch.float64)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert probs[1] > probs[0]


def test_pick_token_greedy_is_argmax():
    logits = rand_logits(50, V, seed=6)
    params = SamplingParams()  # temperature 0 = greedy
    assert params.greedy
    # the generator is not needed (None), and no draw is made
    assert [pick_token(row, params, None) for row in logits] == logits.argmax(-1).tolist()
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    pick_token(logits[0], params, g)
    assert torch.equal(g.get_state(), state)


def test_pick_token_sampled_follows_processed_distribution():
    logits = rand_logits(V, seed=7)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    probs = probs_from_logits(logits, params)
    g = torch.Generator().manual_seed(8)
    counts = torch.bincount(torch.tensor([pick_token(logits, params, g) for _ in range(4000)]), minlength=V)
    assert counts[probs == 0].sum() == 0  # tokens cut by top-k / top-p are never emitted
    kept = probs > 0
    assert chisquare(counts[kept].double().numpy(), (probs[kept] * 4000).numpy()).pvalue > 1e-3


def test_pick_token_top_k_1_is_argmax_and_seeded_draws_repeat():
    logits = rand_logits(20, V, seed=9)
    g = torch.Generator().manual_seed(1)
    assert [pick_token(r, SamplingParams(temperature=1.0, top_k=1), g) for r in logits] == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.5)

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [pick_token(r, params, gen) for r in logits]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": -0.2},
        {"top_p": 1.0001},
        {"top_p": 1.5},
        {"top_k": -1},
    ],
)
def test_sampling_params_rejects_bad_values(kwargs):
    with pytest.raises(AnchorspecError) as err:
        SamplingParams(**kwargs)
    (name,) = kwargs  # the message names the offending field
    assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({}, True),
        ({"temperature": 0.0, "top_p": 1.0, "top_k": 0}, True),
        ({"temperature": 1e-3, "top_p": 1e-6, "top_k": 1}, False),
    ],
)
def test_sampling_params_accepts_edge_values(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy
