"""Verification tests: greedy tables, per-position distribution equality (chain and tree) with
negative controls, seeded determinism, and the residual sampler's degenerate cases.

The statistical tests use a fixed seed, so they are deterministic; the negative controls show
that the very same check rejects a verifier that is known to be lossy.
"""

from __future__ import annotations

import bisect
import functools
import zlib

import pytest
import torch
from scipy.stats import chisquare

import anchorspec.decode.verify as verify_mod
from anchorspec.decode.lookup import merge_chain
from anchorspec.decode.sampling import sample
from anchorspec.decode.tree import DraftTree
from anchorspec.decode.verify import (
    Verdict,
    acceptance_probability,
    verify_greedy,
    verify_sampling,
)

# ---------------------------------------------------------------------------------------------
# 1. Greedy tables (hand-built logits: +100 at the wanted token, -100 elsewhere)
# ---------------------------------------------------------------------------------------------

GV = 16  # vocab for the greedy tables


def want_logits(wanted: list[int]) -> torch.Tensor:
    """Row i has its argmax at wanted[i]."""
    logits = torch.full((len(wanted), GV), -100.0, dtype=torch.float64)
    logits[torch.arange(len(wanted)), torch.tensor(wanted)] = 100.0
    return logits


def chain(tokens: list[int], draft_probs=None) -> DraftTree:
    return DraftTree(torch.tensor(tokens), list(range(-1, len(tokens) - 1)), draft_probs=draft_probs)


# root 9, drafts 1, 2, 3. Rows after a rejected node want the *next draft* token, so a verifier
# that kept reading rows past the first mismatch would accept more than it should.
@pytest.mark.parametrize(
    "wanted, path, next_token",
    [
        ([1, 2, 3, 4], [0, 1, 2, 3], 4),  # perfect match + bonus
        ([7, 2, 3, 4], [0], 7),  # mismatch at the first draft
        ([1, 6, 3, 4], [0, 1], 6),  # mismatch in the middle
        ([1, 2, 0, 4], [0, 1, 2], 0),  # mismatch at the last draft
    ],
)
def test_greedy_chain_table(wanted, path, next_token):
    v = verify_greedy(chain([9, 1, 2, 3]), want_logits(wanted))
    assert v.path == path
    assert v.next_token == next_token
    assert v.accepted == len(path) - 1


def test_greedy_root_only_emits_target_token():
    v = verify_greedy(chain([9]), want_logits([5]))
    assert (v.path, v.next_token, v.accepted) == ([0], 5, 0)


# Static 12-node tree, depth 3 (node: token). Tokens repeat across *different* parents (nodes 2
# and 4 are both 7; nodes 1 and 7 both 4; nodes 3 and 10 both 2), so the verifier must look only
# at the current node's children, and by token, not by node id.
#
#   0:9 ─┬─ 1:4 ─┬─ 4:7 ─┬─ 8:5
#        │       │       └─ 9:6
#        │       ├─ 5:1 ─── 10:2
#        │       └─ 6:3
#        ├─ 2:7 ─── 7:4 ─── 11:8
#        └─ 3:2            (leaf at depth 1)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 1, 2, 4, 4, 5, 7]
TREE_TOKENS = [9, 4, 7, 2, 7, 1, 3, 4, 5, 6, 2, 8]
# Default rows want their first child's token (0 at leaves): a verifier that reads the wrong row
# would wander down a branch that the table below does not expect.
TREE_DEFAULT_WANT = [4, 7, 4, 0, 5, 2, 0, 8, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "override, path, next_token",
    [
        ({0: 5}, [0], 5),  # none accepted (5 exists only deep in the tree)
        ({0: 2, 3: 6}, [0, 3], 6),  # short path ending at a leaf, bonus after the leaf
        ({0: 4, 1: 1, 5: 9}, [0, 1, 5], 9),  # non-longest path, mismatch at depth 2
        ({0: 4, 1: 3}, [0, 1, 6], 0),  # third sibling accepted, bonus after a depth-2 leaf
        ({0: 4, 1: 7, 4: 6, 9: 11}, [0, 1, 4, 9], 11),  # longest path (second grandchild)
        ({0: 7, 2: 4, 7: 8, 11: 0}, [0, 2, 7, 11], 0),  # longest path through the other branch
    ],
)
def test_greedy_static_tree_table(override, path, next_token):
    tree = DraftTree(torch.tensor(TREE_TOKENS), TREE_PARENTS)
    assert tree.size == 12 and tree.depth == 3
    wanted = list(TREE_DEFAULT_WANT)
    for row, tok in override.items():
        wanted[row] = tok
    v = verify_greedy(tree, want_logits(wanted))
    assert v.path == path
    assert v.next_token == next_token
    assert v.path == tree.path_to(v.path[-1])  # a real root-to-node path


# ---------------------------------------------------------------------------------------------
# 2./3. Distribution equality per output position, with negative controls
# ---------------------------------------------------------------------------------------------

V = 6  # small vocab: exact marginals by enumeration are cheap
OUT = 3  # output positions checked per run
N_RUNS = 20_000
N_NEGATIVE = N_RUNS // 4  # negative controls use fewer runs: rejecting with less data is harder
TARGET, DRAFTER = 0, 1
CHAIN_K = 2
TREE_WIDTHS = (3, 2)  # deterministic top-3 children of the root, top-2 below each of them
ALPHA = 1e-3  # positive cases must pass at this level (the seed is fixed, so no flakiness)


@functools.lru_cache(maxsize=None)
def dist(kind: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """A deterministic, context-dependent distribution over V tokens, some entries exactly 0.
    `kind` picks the model (target or drafter), so target and drafter disagree."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((kind, prefix)).encode()))  # stable across runs
    logits = 1.5 * torch.randn(V, generator=g, dtype=torch.float64)
    zero = torch.rand(V, generator=g) < 0.3
    zero[int(torch.randint(V, (1,), generator=g))] = False  # keep at least one token
    return torch.softmax(logits.masked_fill(zero, float("-inf")), dim=-1)


@functools.lru_cache(maxsize=None)
def cdf(kind: int, prefix: tuple[int, ...]) -> list[float]:
    return dist(kind, prefix).cumsum(0).tolist()


def chain_step(prefix: tuple[int, ...], gen, verify) -> tuple[Verdict, list[int]]:
    """Draft CHAIN_K tokens from the drafter q, verify against the target p, return the new tokens."""
    drafts = _draws(prefix, gen)
    tree, target = _chain_inputs(prefix, tuple(drafts))
    v = verify(tree, target, gen)
    return v, [drafts[i - 1] for i in v.path[1:]] + [v.next_token]


@functools.lru_cache(maxsize=None)
def _chain_inputs(prefix, drafts):
    q = [torch.zeros(V, dtype=torch.float64)] + [dist(DRAFTER, prefix + drafts[:i]) for i in range(CHAIN_K)]
    p = [dist(TARGET, prefix + drafts[:i]) for i in range(CHAIN_K + 1)]
    root = prefix[-1] if prefix else 0  # the root token is not re-emitted; its value is irrelevant
    return chain([root, *drafts], torch.stack(q)), torch.stack(p)


def tree_step(prefix: tuple[int, ...], gen, verify) -> tuple[Verdict, list[int]]:
    tree, target = _tree_inputs(prefix)
    v = verify(tree, target, gen)
    tokens = tree.tokens.tolist()
    return v, [tokens[i] for i in v.path[1:]] + [v.next_token]


@functools.lru_cache(maxsize=None)
def _tree_inputs(prefix):
    """Deterministic top-k drafts (EAGLE "target-only" setting): children of a node are the
    drafter's most likely tokens after the node's prefix. Row i of the target is p(prefix + path(i))."""
    tokens, parents, ctx = [prefix[-1] if prefix else 0], [-1], [prefix]
    frontier = [0]
    for width in TREE_WIDTHS:
        new = []
        for node in frontier:
            for tok in torch.topk(dist(DRAFTER, ctx[node]), width).indices.tolist():
                tokens.append(tok)
                parents.append(node)
                ctx.append(ctx[node] + (tok,))
                new.append(len(tokens) - 1)
        frontier = new
    target = torch.stack([dist(TARGET, c) for c in ctx])
    return DraftTree(torch.tensor(tokens), parents), target


def sampled_tree_step(prefix: tuple[int, ...], gen, verify, order=None) -> tuple[Verdict, list[int]]:
    """Children drawn from the drafter's q without replacement (TREE_WIDTHS per level, fewer where q has fewer
    tokens), kept in draw order, each child's draft_probs row its parent's q. `order` (a negative control)
    re-sorts each node's children before verification."""
    tokens, parents, ctx, qrows = [prefix[-1] if prefix else 0], [-1], [prefix], [torch.zeros(V, dtype=torch.float64)]
    frontier = [0]
    for width in TREE_WIDTHS:
        new = []
        for node in frontier:
            q = dist(DRAFTER, ctx[node])
            left = q.clone()
            drawn = []
            for _ in range(min(width, int((q > 0).sum()))):
                c = left.cumsum(0).tolist()
                u = float(torch.rand((), generator=gen, dtype=torch.float64))
                x = min(bisect.bisect_right(c, u * c[-1]), V - 1)
                while left[x] == 0:  # float edge: land on a token that is left
                    x -= 1
                drawn.append(x)
                left[x] = 0
            if order is not None:
                drawn = order(drawn, q)
            for tok in drawn:
                tokens.append(tok)
                parents.append(node)
                ctx.append(ctx[node] + (tok,))
                qrows.append(q)
                new.append(len(tokens) - 1)
        frontier = new
    target = torch.stack([dist(TARGET, c) for c in ctx])
    v = verify(DraftTree(torch.tensor(tokens), parents, draft_probs=torch.stack(qrows)), target, gen)
    return v, [tokens[i] for i in v.path[1:]] + [v.next_token]


def lookup_chain(prefix: tuple[int, ...]) -> list[int]:
    """A context-lookup chain's stand-in: two tokens fixed by the prefix alone (the drafter's likeliest, which a
    draw from q often equals, so the chain often shares the drawn node; then the target's likeliest after it)."""
    first = int(dist(DRAFTER, prefix).argmax())
    return [first, int(dist(TARGET, prefix + (first,)).argmax())]


def lookup_step(prefix: tuple[int, ...], gen, verify, fixed: bool = True) -> tuple[Verdict, list[int]]:
    """A sampled chain of CHAIN_K with a lookup chain merged into it by prefix (the engine's merge_chain): the
    copied tokens the drafter did not draw become fixed nodes. `fixed=False` (a negative control) forgets which
    nodes are fixed, so the verifier tests them with their drawn siblings' q."""
    drawn, _ = _chain_inputs(prefix, tuple(_draws(prefix, gen)))
    tree = merge_chain(drawn, lookup_chain(prefix))
    if not fixed:
        tree = DraftTree(tree.tokens, tree.parents, tree.draft_probs)
    tokens = tree.tokens.tolist()
    ctx = [prefix]
    for node in range(1, tree.size):
        ctx.append(ctx[tree.parents[node]] + (tokens[node],))
    v = verify(tree, torch.stack([dist(TARGET, c) for c in ctx]), gen)
    return v, [tokens[i] for i in v.path[1:]] + [v.next_token]


def _draws(prefix: tuple[int, ...], gen) -> list[int]:
    """CHAIN_K tokens drawn from the drafter's q after `prefix`, each after the ones before."""
    drafts: list[int] = []
    # inverse-CDF draws: several times faster than torch.multinomial for one token
    for u in torch.rand(CHAIN_K, generator=gen, dtype=torch.float64).tolist():
        c = cdf(DRAFTER, prefix + tuple(drafts))
        drafts.append(bisect.bisect_right(c, u * c[-1]))  # zero-probability tokens have empty intervals
    return drafts


def by_q(drawn: list[int], q: torch.Tensor) -> list[int]:
    """The drawn candidates tried most likely first: no longer a draw in order (lossy)."""
    return sorted(drawn, key=lambda x: -float(q[x]))


def verify_sampled_tree_residual_is_p(tree, target_probs, gen) -> Verdict:
    """Lossy: every sampled sibling tested with min(1, p/q) against the node's unchanged p (no residual)."""
    tokens, node, path = tree.tokens.tolist(), 0, [0]
    while True:
        p = target_probs[node]
        children = tree.children[node]
        q = tree.draft_probs[children[0]].clone() if children else None
        for child in children:
            x = tokens[child]
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < acceptance_probability(p[x], q[x]):
                node = child
                path.append(node)
                break
            q[x] = 0
            q = q / q.sum() if q.sum() > 0 else q
        else:
            return Verdict(path, sample(p, gen))


def simulate(step, verify, n: int, seed: int):
    """n independent generations from an empty context; returns the first OUT emitted tokens of
    each [n, OUT] and every verdict (for the coverage checks)."""
    gen = torch.Generator().manual_seed(seed)
    out, verdicts = [], []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < OUT:
            v, new = step(tuple(seq), gen, verify)
            verdicts.append(v)
            seq += new
        out.append(seq[:OUT])
    return torch.tensor(out), verdicts


@functools.lru_cache(maxsize=None)
def exact_joint() -> torch.Tensor:
    """[V, V, V]: the target's probability of each 3-token continuation, by enumeration."""
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            joint[a, b] = dist(TARGET, ())[a] * dist(TARGET, (a,))[b] * dist(TARGET, (a, b))
    return joint


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit. Any count in a zero-probability cell is an outright failure;
    cells expected to hold < 5 are pooled so the test stays valid."""
    observed, probs = observed.flatten().double(), probs.flatten()
    n = observed.sum()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # scipy demands exactly matching totals
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def position_pvalues(samples: torch.Tensor) -> dict[str, float]:
    """p-values for each output position's marginal, the joint of positions 1-2, and all three."""
    joint = exact_joint()
    counts = torch.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V**3).view(V, V, V)
    return {
        "pos1": chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))),
        "pos2": chi2_pvalue(counts.sum((0, 2)), joint.sum((0, 2))),
        "pos3": chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1))),
        "joint12": chi2_pvalue(counts.sum(2), joint.sum(2)),
        "joint123": chi2_pvalue(counts, joint),
    }


def assert_matches_target(pvalues: dict[str, float]):
    bad = {k: p for k, p in pvalues.items() if p < ALPHA}
    assert not bad, f"output distribution differs from the target: {pvalues}"


def always_accept(p_x, q_x) -> float:
    return 1.0


def ignore_q(p_x, q_x) -> float:
    """Accept a sampled draft with probability p(x), as if q were a point mass (wrong for sampled drafts)."""
    return float(p_x)


def verify_chain_residual_is_p(tree, target_probs, gen) -> Verdict:
    """Lossy chain verifier: after a rejection, the correction comes from p instead of norm(max(p - q, 0))."""
    v = verify_sampling(tree, target_probs, gen)
    if v.accepted < tree.size - 1:
        v = Verdict(v.path, sample(target_probs[v.path[-1]], gen))
    return v


def test_synthetic_models_disagree():
    """Sanity of the setup itself: target and drafter differ and both have zeros somewhere, so
    the test exercises q(x) = 0 < p(x) and p(x) = 0 < q(x)."""
    p, q = dist(TARGET, ()), dist(DRAFTER, ())
    assert (p - q).abs().sum() > 0.3
    rows = [dist(k, (a,)) for k in (TARGET, DRAFTER) for a in range(V)]
    assert any((r == 0).any() for r in rows)
    assert torch.allclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_chain_sampling_matches_target_per_position():
    samples, verdicts = simulate(chain_step, verify_sampling, N_RUNS, seed=1)
    assert_matches_target(position_pvalues(samples))
    # every branch of the verifier was exercised: rejection at each draft, and the bonus
    accepted = torch.bincount(torch.tensor([v.accepted for v in verdicts]), minlength=CHAIN_K + 1)
    assert (accepted > 0.05 * N_RUNS).all(), accepted


def test_tree_sampling_matches_target_per_position():
    samples, verdicts = simulate(tree_step, verify_sampling, N_RUNS, seed=2)
    assert_matches_target(position_pvalues(samples))
    depths = torch.bincount(torch.tensor([v.accepted for v in verdicts]), minlength=3)
    assert (depths > 0.05 * N_RUNS).all(), depths
    # non-first siblings get accepted too (the renormalize-and-retry branch)
    # depth-1 nodes are 1, 2, 3 in drafter order, so nodes 2 and 3 are non-first siblings
    assert sum(v.path[1] in (2, 3) for v in verdicts if v.accepted) > 0.05 * N_RUNS


def test_sampled_tree_matches_target_per_position():
    """Children drawn from q without replacement, verified by recursive rejection sampling (the residual)."""
    samples, verdicts = simulate(sampled_tree_step, verify_sampling, N_RUNS, seed=5)
    assert_matches_target(position_pvalues(samples))
    depths = torch.bincount(torch.tensor([v.accepted for v in verdicts]), minlength=3)
    assert (depths > 0.05 * N_RUNS).all(), depths
    later = sum(v.path[1] != 1 for v in verdicts if v.accepted)  # a sibling after a rejected first draw
    assert later > 0.05 * N_RUNS


def test_sampled_chain_with_a_lookup_chain_matches_target_per_position():
    """Copied tokens beside drawn ones (decode/lookup.py at T > 0): fixed nodes tested with p(x), drawn ones with
    min(1, p/q) and the residual, in one walk; every kind of step is exercised."""
    samples, verdicts = simulate(lookup_step, verify_sampling, N_RUNS, seed=7)
    assert_matches_target(position_pvalues(samples))
    # the path went through a fixed node (a copied token the drafter had not drawn) often enough, and through
    # a drawn node the chain shared: reconstructing which is which needs the trees, so count by node index
    # (the sampled chain holds nodes 1..CHAIN_K, merge_chain appends the fixed ones after them)
    through_fixed = sum(any(node > CHAIN_K for node in v.path) for v in verdicts)
    assert through_fixed > 0.05 * len(verdicts), through_fixed
    assert sum(v.accepted == 0 for v in verdicts) > 0.05 * len(verdicts)


def test_lookup_nodes_tested_with_the_drawn_q_are_detected():
    """The negative control: the same trees, but the fixed nodes tested as if drawn from their siblings' q."""
    samples, _ = simulate(functools.partial(lookup_step, fixed=False), verify_sampling, N_NEGATIVE * 2, seed=8)
    pvalues = position_pvalues(samples)
    with pytest.raises(AssertionError):
        assert_matches_target(pvalues)
    assert min(pvalues.values()) < 1e-8, pvalues


@pytest.mark.parametrize(
    "step, verify",
    [(functools.partial(sampled_tree_step, order=by_q), verify_sampling),
     (sampled_tree_step, verify_sampled_tree_residual_is_p)],
    ids=["sampled-tree-tried-by-q", "sampled-tree-residual-is-p"],
)
def test_sampled_tree_negative_controls_are_detected(step, verify):
    """Sampled siblings re-sorted by q (the draw order lost), or tested against p itself: lossy, and detected."""
    samples, _ = simulate(step, verify, N_NEGATIVE * 2, seed=6)
    pvalues = position_pvalues(samples)
    with pytest.raises(AssertionError):
        assert_matches_target(pvalues)
    assert min(pvalues.values()) < 1e-8, pvalues


@pytest.mark.parametrize(
    "step, verify, patch",
    [
        (chain_step, verify_sampling, always_accept),
        (tree_step, verify_sampling, always_accept),
        (chain_step, verify_sampling, ignore_q),
        (chain_step, verify_chain_residual_is_p, None),
    ],
    ids=["chain-always-accept", "tree-always-accept", "chain-acceptance-ignores-q", "chain-residual-is-p"],
)
def test_negative_control_is_detected(monkeypatch, step, verify, patch):
    """The same check must reject a verifier that is known to change the output distribution."""
    if patch is not None:
        monkeypatch.setattr(verify_mod, "acceptance_probability", patch)
    samples, _ = simulate(step, verify, N_NEGATIVE, seed=3)
    pvalues = position_pvalues(samples)
    with pytest.raises(AssertionError):
        assert_matches_target(pvalues)
    assert min(pvalues.values()) < 1e-8, pvalues


# ---------------------------------------------------------------------------------------------
# 4. Seeded determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [chain_step, tree_step], ids=["chain", "tree"])
def test_same_seed_same_verdicts_different_seed_differs(step):
    def run(seed):
        _, verdicts = simulate(step, verify_sampling, 300, seed)
        return [(v.path, v.next_token) for v in verdicts]

    assert run(11) == run(11)
    assert run(11) != run(12)


# ---------------------------------------------------------------------------------------------
# 5. Residual sampler: degenerate cases
# ---------------------------------------------------------------------------------------------


def _rand_probs(g, n, zero_frac=0.0, dtype=torch.float64):
    x = torch.rand(n, generator=g, dtype=torch.float64).masked_fill(torch.rand(n, generator=g) < zero_frac, 0.0)
    x[int(torch.randint(n, (1,), generator=g))] += 0.5  # never all zero
    return (x / x.sum()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_q_equal_p_is_never_rejected(dtype):
    g = torch.Generator().manual_seed(0)
    k, v = 3, 10
    for _ in range(300):
        p = torch.stack([_rand_probs(g, v, 0.3, dtype) for _ in range(k + 1)])
        drafts = [sample(p[i], g) for i in range(k)]  # drafts from q == p
        q = torch.cat([torch.zeros(1, v, dtype=dtype), p[:k]])
        for i, x in enumerate(drafts):
            assert acceptance_probability(p[i, x], q[i + 1, x]) == 1.0
        verdict = verify_sampling(chain([0, *drafts], q), p, g)
        assert verdict.path == [0, 1, 2, 3]
        assert p[k, verdict.next_token] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_disjoint_supports_always_rejected_and_correction_from_p(dtype):
    g = torch.Generator().manual_seed(1)
    v = 8
    p = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0], dtype=dtype)
    q = torch.tensor([0, 0, 0, 0.25, 0.25, 0.25, 0.25, 0], dtype=dtype)
    target = torch.stack([p, p, p])
    counts = torch.zeros(v)
    for _ in range(1500):
        drafts = [sample(q, g), sample(q, g)]
        verdict = verify_sampling(chain([0, *drafts], torch.stack([q, q, q])), target, g)
        assert verdict.path == [0]
        counts[verdict.next_token] += 1
    assert counts[3:].sum() == 0  # nothing outside p's support
    assert chi2_pvalue(counts, p.double()) > ALPHA  # residual max(p - q, 0) == p here


def test_acceptance_probability_edge_values():
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    assert acceptance_probability(t(0.2), t(0.4)) == pytest.approx(0.5)
    assert acceptance_probability(t(0.4), t(0.2)) == 1.0
    assert acceptance_probability(t(0.3), t(0.0)) == 0.0  # q(x) = 0: such a draft cannot be trusted
    assert acceptance_probability(t(0.0), t(0.3)) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_never_emits_zero_probability_tokens(dtype):
    """Random p and q with zeros, plus q within float noise of p (a near-empty residual, the vLLM
    zero-mass-tail regression): accepted drafts have p > 0 and the correction/bonus has p > 0."""
    g = torch.Generator().manual_seed(2)
    k, v = 3, 12
    for trial in range(600):
        p = torch.stack([_rand_probs(g, v, 0.5, dtype) for _ in range(k + 1)])
        if trial % 3 == 0:  # q = p up to rounding: rejections are rare, residual mass is tiny
            q_rows = (p[:k] * (1 + 1e-6 * torch.randn(k, v, generator=g, dtype=torch.float64)).to(dtype)).clamp(min=0)
            q_rows = q_rows / q_rows.sum(-1, keepdim=True)
        else:
            q_rows = torch.stack([_rand_probs(g, v, 0.5, dtype) for _ in range(k)])
        drafts = [sample(q_rows[i], g) for i in range(k)]
        verdict = verify_sampling(chain([0, *drafts], torch.cat([torch.zeros(1, v, dtype=dtype), q_rows])), p, g)
        for node in verdict.path[1:]:
            assert p[node - 1, drafts[node - 1]] > 0
        assert 0 <= verdict.next_token < v
        assert p[verdict.path[-1], verdict.next_token] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_never_emits_zero_probability_tokens(dtype):
    """Random depth-2 trees whose children include zero-probability tokens and, at times, cover
    all of p's support (then one of them must be accepted; the leftover p is empty)."""
    g = torch.Generator().manual_seed(3)
    v = 8
    parents = [-1, 0, 0, 0, 1, 1, 2]
    covered = 0
    for _ in range(1200):
        target = torch.stack([_rand_probs(g, v, 0.6, dtype) for _ in parents])
        tokens = [0]
        for node, par in enumerate(parents[1:], start=1):
            siblings = [tokens[c] for c in range(1, node) if parents[c] == par]
            choices = [t for t in torch.randperm(v, generator=g).tolist() if t not in siblings]
            tokens.append(choices[0])
        root_support = set(torch.nonzero(target[0]).flatten().tolist())
        covered += root_support <= {tokens[1], tokens[2], tokens[3]}
        verdict = verify_sampling(DraftTree(torch.tensor(tokens), parents), target, g)
        assert verdict.path == DraftTree(torch.tensor(tokens), parents).path_to(verdict.path[-1])
        for node in verdict.path[1:]:
            assert target[parents[node], tokens[node]] > 0
        assert 0 <= verdict.next_token < v
        assert target[verdict.path[-1], verdict.next_token] > 0
        if root_support <= {tokens[1], tokens[2], tokens[3]}:
            assert verdict.accepted >= 1  # all of p's mass is on the children: one must be accepted
    assert covered > 20  # the "children cover the support" case really happened


def test_tree_zero_probability_children_never_accepted():
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.0, 0.0, 0.6, 0.4], dtype=torch.float64)
    tree = DraftTree(torch.tensor([3, 0, 1, 2]), [-1, 0, 0, 0])  # children: two zeros, then token 2
    target = torch.stack([p] * 4)
    paths = [verify_sampling(tree, target, g).path for _ in range(500)]
    assert all(path[1:] in ([], [3]) for path in paths)
    assert sum(path == [0, 3] for path in paths) > 200  # token 2 (p = 0.6) is accepted often
