"""benchmarks/draft_temperature.py's multi-candidate acceptance: top-k is the target's mass on q's top tokens, and
candidates sampled without replacement under recursive rejection sampling accept what an exact enumeration says
(one candidate: the chain's overlap, sum min(p, q))."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from draft_temperature import sampled_candidates_acceptance, topk_acceptance  # noqa: E402


def exact_recursive(p: list[float], q: list[float], k: int) -> float:
    """The chance that k candidates drawn from q without replacement accept one, by enumerating every ordered
    draw (p's missing mass sits outside q's support)."""
    p = p + [1 - sum(p)]
    q = q + [0.0]
    total = 0.0
    for draw in itertools.permutations([x for x in range(len(q)) if q[x] > 0], k):
        chance, P, Q, missed = 1.0, list(p), list(q), 1.0
        for x in draw:
            chance *= Q[x] / sum(Q)
            Qn = [v / sum(Q) for v in Q]
            missed *= 1 - min(1.0, P[x] / Qn[x])
            P = [max(a - b, 0.0) for a, b in zip(P, Qn)]
            P = [v / sum(P) for v in P] if sum(P) > 0 else P
            Q = [0.0 if i == x else v for i, v in enumerate(Qn)]
        total += chance * (1 - missed)
    return total


@pytest.fixture
def pq():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, generator=g, dtype=torch.float64) * 2, -1) * torch.tensor([[1.0], [0.9], [0.7]],
                                                                                                  dtype=torch.float64)
    q = torch.softmax(torch.randn(3, 5, generator=g, dtype=torch.float64) * 2, -1)
    return p, q


def test_topk_is_the_target_mass_on_the_drafters_top_tokens(pq):
    p, q = pq
    got = topk_acceptance(p, q, 3)
    for r in range(3):
        top = q[r].argsort(descending=True)
        for k in range(3):
            assert got[r, k] == pytest.approx(float(p[r, top[:k + 1]].sum()))


def test_sampled_candidates_match_the_exact_enumeration(pq):
    p, q = pq
    got = sampled_candidates_acceptance(p, q, 3, samples=20000, generator=torch.Generator().manual_seed(1))
    for r in range(3):
        assert got[r, 0] == pytest.approx(float(torch.minimum(p[r], q[r]).sum()), abs=0.01)  # the chain's overlap
        for k in range(3):
            assert got[r, k] == pytest.approx(exact_recursive(p[r].tolist(), q[r].tolist(), k + 1), abs=0.01)
    assert (got[:, 1:] >= got[:, :-1] - 1e-12).all()  # another candidate never lowers it


def test_the_residual_is_what_the_sampled_candidates_are_tested_against():
    """A negative control: testing every candidate against p itself (no residual, not lossless) accepts more
    than the estimate does, and the estimate agrees with the recursive enumeration instead."""
    p = torch.tensor([[0.6, 0.1, 0.1, 0.0]], dtype=torch.float64)  # 0.2 of the target's mass outside q's support
    q = torch.tensor([[0.1, 0.3, 0.3, 0.3]], dtype=torch.float64)
    got = sampled_candidates_acceptance(p, q, 3, samples=20000, generator=torch.Generator().manual_seed(2))[0]
    for k in (2, 3):
        exact, wrong = exact_recursive(p[0].tolist(), q[0].tolist(), k), naive(p[0], q[0], k)
        assert wrong - exact > 0.09
        assert got[k - 1] == pytest.approx(exact, abs=0.01)


def naive(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """Each of q's candidates tested with min(1, p(x) / q_i(x)) against the unchanged p (not lossless)."""
    total = 0.0
    pl, ql = p.tolist(), q.tolist()
    for draw in itertools.permutations(range(len(ql)), k):
        chance, Q, missed = 1.0, list(ql), 1.0
        for x in draw:
            chance *= Q[x] / sum(Q)
            Qn = [v / sum(Q) for v in Q]
            missed *= 1 - min(1.0, pl[x] / Qn[x])
            Q = [0.0 if i == x else v for i, v in enumerate(Qn)]
        total += chance * (1 - missed)
    return total
