"""Draft trees: the data structure, its attention mask, and the EAGLE-2 dynamic expansion.

Node 0 is the root: the last sampled token, not yet seen by the target. Parents always come before
their children, so ancestor sets and masks are built in one pass. A chain is a tree whose node i
has parent i-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from ..errors import AnchorspecError
from ..models.masks import additive_mask
from .program import run


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: expand `top_k` children per node, `depth` draft levels,
    keep `total_tokens` nodes including the root. `top_k=1, total=depth+1` is a chain."""

    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self):
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 2:
            raise AnchorspecError(
                f"tree shape needs top_k>=1, depth>=1, total_tokens>=2; got {self.top_k},{self.depth},{self.total_tokens}"
            )

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'TOP_K,DEPTH,TOTAL' (e.g. '4,4,16'; '1,K,K+1' is a chain of K)."""
        try:
            top_k, depth, total = (int(x) for x in text.split(","))
        except ValueError:
            raise AnchorspecError(f"a draft shape is three integers TOP_K,DEPTH,TOTAL, got {text!r}") from None
        return cls(top_k, depth, total)

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls(top_k=1, depth=k, total_tokens=k + 1)

    def capped(self, depth: int) -> "TreeShape | None":
        """This shape with at most `depth` levels (None if depth < 1); a cut tree keeps its top_k and
        node budget, a cut chain stays a chain."""
        if depth < 1:
            return None
        if depth >= self.depth:
            return self
        return TreeShape.chain(depth) if self.is_chain else TreeShape(self.top_k, depth, self.total_tokens)

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    @property
    def max_nodes(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] target token ids, tokens[0] = root
    parents: list[int]  # parents[0] = -1
    draft_probs: torch.Tensor | None = None  # [N, V] the q each node's token was drawn from (sampled drafts)
    # nodes of a sampled draft that were not drawn from any q (a context-lookup chain's copied tokens): each is
    # a fixed candidate, tested with p(x) as a point mass (decode/verify.py); their draft_probs rows are zero
    fixed: frozenset[int] = frozenset()
    depths: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self):
        if len(self.parents) != self.tokens.numel() or self.parents[0] != -1:
            raise AnchorspecError("draft tree: parents must have one entry per token and parents[0] == -1")
        if self.fixed and (self.draft_probs is None or 0 in self.fixed or max(self.fixed) >= len(self.parents)):
            raise AnchorspecError("draft tree: fixed nodes are non-root nodes of a sampled draft (with draft_probs)")
        self.depths = [0] * len(self.parents)
        self.children = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise AnchorspecError(f"draft tree: node {i} has parent {p}; parents must precede children")
            self.depths[i] = self.depths[p] + 1
            self.children[p].append(i)

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "DraftTree":
        """`tokens` as a chain (a prompt, too: a prefill is a forward like any other step's)."""
        return cls(tokens, list(range(-1, tokens.numel() - 1)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def depth_ordered(self) -> bool:
        """No node is shallower than the one before it, so the first levels are a prefix of the rows
        (EAGLE-2 expansion and chains build trees this way)."""
        return all(a <= b for a, b in zip(self.depths, self.depths[1:]))

    @property
    def is_chain(self) -> bool:
        """Each node's parent is the node before it: attention within the tree is plain causal."""
        return self.depths[-1] == self.size - 1

    def top_ranked_run(self, path: list[int]) -> int:
        """How many nodes of an accepted `path` (root first), from its start, are each their parent's
        first child: the drafter's top-ranked token there (children are made best first, and a kept
        child's better siblings are kept too). For a tree this is what the chain of its top-1 tokens
        would have had accepted; for a chain it is the accepted length."""
        run = 0
        for node in path[1:]:
            if self.children[self.parents[node]][0] != node:
                break
            run += 1
        return run

    @property
    def top_ranked_depth(self) -> int:
        """How deep the path of first children from the root goes: the chain of the drafter's top-1
        tokens that this tree contains."""
        node, depth = 0, 0
        while self.children[node]:
            node, depth = self.children[node][0], depth + 1
        return depth

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: anc[i, j] = j is i or an ancestor of i."""
        n = self.size
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def _induced(self, nodes: list[int]) -> "DraftTree":
        """The tree on `nodes` (ascending, closed under parents within the set, nodes[0] the new root)."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = [-1] + [index[self.parents[node]] for node in nodes[1:]]
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs[nodes].clone()
            probs[0] = 0  # a root is not a draft
        fixed = frozenset(index[node] for node in nodes[1:] if node in self.fixed)
        return DraftTree(self.tokens[nodes].clone(), parents, probs, fixed)

    def levels(self, depth: int) -> tuple["DraftTree", list[int]]:
        """The first `depth` levels as a tree, and the node of this tree behind each of its nodes."""
        kept = [i for i, d in enumerate(self.depths) if d <= depth]
        return (self._induced(kept) if len(kept) < self.size else self), kept

    def subtree(self, node: int) -> "DraftTree":
        """`node` and its descendants, with `node` as the root."""
        inside = [False] * self.size
        inside[node] = True
        for i in range(node + 1, self.size):  # parents precede children: one pass
            inside[i] = inside[self.parents[i]]
        return self._induced([i for i in range(node, self.size) if inside[i]])


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, N, past_len + N]: every node sees the whole committed context, then
    itself and its ancestors only (the same attention it would get on its own branch)."""
    anc = tree.ancestors()
    allowed = torch.cat([torch.ones(tree.size, past_len, dtype=torch.bool), anc], dim=1)
    return additive_mask(allowed.to(device), dtype)[None, None]


def tree_position_ids(tree: DraftTree, past_len: int) -> torch.Tensor:
    return torch.tensor(tree.depths, dtype=torch.long) + past_len


# An expansion request: (nodes, tokens, parents). `nodes` are candidate ids (creation order),
# `tokens` their token ids, `parents` their parents' candidate ids (-1 for the root). The reply:
# (child tokens [len(nodes), k], child log-probs [len(nodes), k]). The proposer keeps whatever
# per-node state it needs by id.
Expansion = tuple[list[int], list[int], list[int]]
Expander = Callable[[list[int], list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]


def dynamic_tree(root_token: int, first_tokens: torch.Tensor, first_logp: torch.Tensor,
                 shape: TreeShape) -> Generator[Expansion, tuple[torch.Tensor, torch.Tensor], DraftTree]:
    """EAGLE-2 dynamic tree (spec §6.1 step 2), as a program: it yields one Expansion per level
    after the first, receives the children, and returns the DraftTree.

    Level 1 is the top-k of the drafter's prediction after the root. Each further level expands
    the current frontier (top-k nodes by cumulative log-prob) into k children each; all candidates
    are kept, and at the end the `total_tokens - 1` best by cumulative log-prob form the tree.
    A child's score never exceeds its parent's, and ties rank the earlier-created node (the parent)
    first, so the selection is closed under ancestors. An expander prunes a node by giving its
    children -inf: they are never kept or expanded, and expansion stops early once nothing is left.
    """
    k = shape.top_k
    tokens = first_tokens[:k].tolist()  # the tree is host bookkeeping: one transfer per level, wherever the drafter runs
    scores = first_logp[:k].double().tolist()
    parents = [-1] * len(tokens)  # -1 = root, indices otherwise refer to candidate list
    frontier = list(range(len(tokens)))
    for _level in range(2, shape.depth + 1):
        child_tokens, child_logp = yield frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier]
        base = torch.tensor([scores[i] for i in frontier], dtype=torch.float64)[:, None]
        cum = (base + child_logp.to("cpu", torch.float64)).tolist()
        start = len(tokens)
        for row, (parent, children) in enumerate(zip(frontier, child_tokens.tolist())):
            for col, token in enumerate(children):
                tokens.append(token)
                scores.append(cum[row][col])
                parents.append(parent)
        new = torch.tensor(scores[start:], dtype=torch.float64)
        best = torch.topk(new, min(k, new.numel())).indices.sort().values
        frontier = [start + int(i) for i in best if new[i] > float("-inf")]  # -inf: pruned by the expander
        if not frontier:
            break
    keep_n = min(shape.total_tokens - 1, sum(s > float("-inf") for s in scores))
    order = torch.sort(torch.tensor(scores, dtype=torch.float64), descending=True, stable=True).indices
    kept = sorted(int(i) for i in order[:keep_n])  # creation order: parents before children
    index = {cand: node for node, cand in enumerate(kept, start=1)}
    tree_parents = [-1] + [0 if parents[c] == -1 else index[parents[c]] for c in kept]
    tree_tokens = torch.tensor([root_token] + [tokens[c] for c in kept], dtype=torch.long)
    return DraftTree(tokens=tree_tokens, parents=tree_parents)


def sampled_tree(root_token: int, first_tokens: torch.Tensor, first_logp: torch.Tensor, first_probs: torch.Tensor,
                 shape: TreeShape) -> Generator[Expansion, tuple, DraftTree]:
    """A sampled tree as a program (the shape of `dynamic_tree`'s): `first_tokens` are top_k draws from the
    root's q without replacement, in draw order (`first_logp` their log q, -inf for a draw q gave no
    mass: no node); below each, a sampled chain, one draw a node, as deep as `depth` and
    `total_tokens` allow for every chain. The expander answers (tokens [rows, 1], log q [rows, 1], q
    [rows, V]); each node carries its parent's q as its draft_probs row.

    Recursive rejection (decode/verify.py) needs a node's children to be exactly its draws, whatever
    they turned out to be, so nothing here depends on a draw's value: the root keeps all its draws,
    every chain is as long as the others (a -inf draw ends its chain: the drafter pruned it), and
    multi-candidate gains sit at the first level, where they weigh most (SpecTr's k drafts of one
    length).
    """
    width = len([x for x in first_logp[:shape.top_k].tolist() if x > float("-inf")])
    tokens = first_tokens[:width].tolist()  # draws of q = 0 come last (the Gumbel keys of -inf)
    parents = [-1] * width
    q_rows = [first_probs] * width
    depth = min(shape.depth, (shape.total_tokens - 1) // max(width, 1))
    tips = list(range(width))
    for _level in range(2, depth + 1):
        if not tips:
            break
        child_tokens, child_logp, child_probs = yield tips, [tokens[i] for i in tips], [parents[i] for i in tips]
        logp = child_logp.to("cpu", torch.float64)[:, 0].tolist()
        new = []
        for row, (tip, token) in enumerate(zip(tips, child_tokens[:, 0].tolist())):
            if logp[row] > float("-inf"):
                tokens.append(token)
                parents.append(tip)
                q_rows.append(child_probs[row])
                new.append(len(tokens) - 1)
        tips = new
    tree_parents = [-1] + [p + 1 for p in parents]  # candidate i is node i + 1; the root's children point at 0
    draft_probs = torch.stack([torch.zeros_like(first_probs)] + q_rows)
    return DraftTree(torch.tensor([root_token] + tokens, dtype=torch.long), tree_parents, draft_probs=draft_probs)


def build_dynamic_tree(root_token: int, first_tokens: torch.Tensor, first_logp: torch.Tensor,
                       expand: Expander, shape: TreeShape) -> DraftTree:
    """`dynamic_tree` with each expansion answered by a callback."""
    return run(dynamic_tree(root_token, first_tokens, first_logp, shape), lambda request: expand(*request))
