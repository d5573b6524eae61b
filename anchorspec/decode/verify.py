"""Verification: which drafted tokens the target accepts, and the token it adds (pure functions).

- greedy: walk down from the root, following the child equal to the target's argmax.
- sampled: recursive multi-draft rejection over each node's children, in order. With deterministic
  (top-k) drafts, q = 1 ("target-only", spec §7): accept x with probability p(x), otherwise set
  p(x) = 0, renormalize, try the next child. With children drawn from q without replacement (their q
  kept): accept with min(1, p/q), otherwise p = norm(max(p - q, 0)) and q loses x. If all fail, draw
  from what is left of p. A sampled chain is the one-child case: standard speculative sampling, with
  the bonus from p after a fully accepted chain. A sampled draft's fixed nodes (tree.fixed: a lookup
  chain's copied tokens, drawn from no q) are tested as deterministic drafts among the drawn siblings:
  whatever p is left when one is tried, accepting its x with p(x) and otherwise drawing from p without x
  is a draw from that p, so any mix of drawn and fixed candidates keeps the target's distribution.
Both return the accepted root-to-node path and one token drawn from the target, so the output
distribution is exactly the target's.

The logits may cover only the first R nodes (staged verification, decode/engine.py: a depth-ordered
tree whose deepest levels were not forwarded). A node past them can still be accepted, since its
test needs only its parent's row; it then ends the walk as the next token (`held`), and the target
sees it, as the root of the next step's tree, in the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.dtype import argmax_last
from .sampling import sample
from .tree import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted nodes, root (0) first
    next_token: int  # from the target: correction after a rejection, bonus after a full path
    held: int | None = None  # the accepted node past the forwarded rows whose token next_token is

    @property
    def accepted(self) -> int:
        return len(self.path) - 1


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> float:
    """min(1, p/q): the one place a negative-control test can break losslessness."""
    if q_x <= 0:
        return 0.0
    return float(torch.clamp(p_x / q_x, max=1.0))


_POINT_MASS = torch.tensor(1.0, dtype=torch.float64)  # q(x) of a deterministic draft


def _uniform(generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """target_logits [N, V]: row i is the target's prediction after node i."""
    best = argmax_last(target_logits).tolist()
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        want = best[node]
        child = next((c for c in tree.children[node] if tokens[c] == want), None)
        if child is None or child >= len(best):
            return Verdict(path, want, held=child)
        node = child
        path.append(node)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator) -> Verdict:
    """target_probs [N, V] (already temperature/top-k/top-p processed). Each node's children are tried in
    their order. Without tree.draft_probs they are deterministic (top-k) drafts, q a point mass on each
    (spec §7's q = 1). With it, they were drawn from their parent's q (every child's row) without replacement,
    in this order: recursive rejection sampling (Jeon et al. 2024) accepts x with min(1, p(x) / q(x)), and
    after a rejection continues with p = norm(max(p - q, 0)) and q without x, renormalised. A chain with
    draft_probs is the one-child case: standard speculative sampling."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        children = tree.children[node]
        drawn = [c for c in children if c not in tree.fixed]  # the siblings drawn from their parent's q
        q = tree.draft_probs[drawn[0]].to(p.dtype).clone() if tree.draft_probs is not None and drawn else None
        for child in children:
            x = tokens[child]
            point = q is None or child in tree.fixed
            if _uniform(generator) < acceptance_probability(p[x], _POINT_MASS if point else q[x]):
                if child >= target_probs.shape[0]:
                    return Verdict(path, x, held=child)
                node = child
                path.append(node)
                break
            if point:  # x is ruled out: try the next child under p without it
                p = p.clone()
                p[x] = 0
                p = p / p.sum()
                continue
            residual = torch.clamp(p - q, min=0)
            if residual.sum() > 0:  # 0 only where p == q, which rejects with probability 0: keep p then
                p = residual / residual.sum()
            q[x] = 0
            if q.sum() > 0:
                q = q / q.sum()
        else:
            return Verdict(path, sample(p, generator))
