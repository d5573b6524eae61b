"""Context lookup: a draft chain copied from the sequence itself, merged into the drafter's tree.

Where the last few tokens of a sequence occurred before in it (prompt or answer), the tokens that
followed that occurrence are a draft that costs no forward: quoted input (extraction, summaries,
code edits), lists and repeated phrasing, and the loops a small target falls into at greedy
decoding. The drafter predicts these too, but never deeper than its shape; a lookup chain can run
as far as the repetition does. The chain is merged into the drafter's tree by prefix (a lookup
token the drafter also proposed shares its node), so greedy verification accepts the longer of
the two paths and the drafter's own acceptance is never lost; what the lookup costs is its extra
verify rows. Its length adapts to how much the previous chain had accepted (2 * accepted + 2; 4
after a step that found no match), so outside a repetition it adds a row or two. With no drafter the
chain is the whole draft (prompt lookup: `generate_prompt_lookup`, `generate --lookup` without
`--drafter`), a speedup for any target without training anything.

In a sampled draft a copied token is a fixed candidate (`DraftTree.fixed`), tested with probability p(x)
beside the drawn ones (decode/verify.py). Sampled text repeats less: along the target's own answers a chain
alone wins 0.71 tokens a step at T=0, 0.29 at T=0.7 with top-p 0.9 and 0.036 at T=1 (sessions 70 and 74).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import AnchorspecError
from .tree import DraftTree


NO_MATCH_LIMIT = 4  # a chain's length after a step that found no match (replayed on MT-bench: session 69)


def next_chain_length(accepted: int | None) -> int:
    """The adaptive length of a copied or retrieved chain: 2 * what the last one accepted + 2, so a run of
    full acceptances grows it fast and a miss shrinks it to two rows; NO_MATCH_LIMIT when no chain was
    proposed (no occurrence says nothing against copying)."""
    return NO_MATCH_LIMIT if accepted is None else 2 * accepted + 2


@dataclass(frozen=True)
class LookupSettings:
    """`max_tokens`: the longest chain; `min_match`, `max_match`: the suffix lengths looked up (the
    longest that occurred before wins, its most recent occurrence)."""

    max_tokens: int = 16
    min_match: int = 2
    max_match: int = 8

    def __post_init__(self):
        if self.max_tokens < 1:
            raise AnchorspecError(f"a lookup chain needs at least 1 token, got {self.max_tokens}")
        if not 1 <= self.min_match <= self.max_match:
            raise AnchorspecError(f"lookup match lengths need 1 <= min <= max, got {self.min_match}, {self.max_match}")


class ContextLookup:
    """Per sequence: an index from each n-gram (n in min_match..max_match) to the position after its
    latest occurrence, grown as the sequence is, and the adaptive chain length."""

    def __init__(self, settings: LookupSettings = LookupSettings()):
        self.settings = settings
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it, latest
        self.indexed = 0  # n-grams ending before this index are in `after`
        self.limit = NO_MATCH_LIMIT  # the next chain's length (before `max_tokens` and the room left)

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def _index_to(self, end: int) -> None:
        """Index every n-gram that ends before `end` (the suffix ending at `end` itself is the query)."""
        lo, hi = self.settings.min_match, self.settings.max_match
        for stop in range(self.indexed + 1, end):
            for n in range(lo, min(hi, stop) + 1):
                self.after[tuple(self.tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end - 1)

    def propose(self, room: int) -> list[int]:
        """The chain to draft after the sequence's last token (the pending root): at most `room`
        tokens, `max_tokens` and the adaptive length. Copied with overlap, so a loop shorter than the
        chain repeats."""
        s = self.settings
        limit = min(room, s.max_tokens, self.limit)
        end = len(self.tokens)
        if limit < 1 or end < s.min_match + 1:
            return []
        self._index_to(end)
        for n in range(min(s.max_match, end - 1), s.min_match - 1, -1):
            start = self.after.get(tuple(self.tokens[end - n:]))
            if start is not None:
                chain: list[int] = []
                for i in range(limit):
                    j = start + i
                    chain.append(self.tokens[j] if j < end else chain[j - end])
                return chain
        return []

    def observe(self, accepted: int | None) -> None:
        """How many of the last proposed chain's tokens the target accepted; None: no chain was proposed
        (no earlier occurrence), which says nothing against copying, so the next one starts mid-length."""
        self.limit = next_chain_length(accepted)


def merge_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """`tree` with `chain` (tokens after the root) added by prefix: existing nodes are followed while
    they match, the rest is appended as new nodes after all of the tree's, so the drafter's nodes
    keep their indices and its first children stay first (`tree` itself when all are shared). In a sampled
    draft the new nodes are fixed: drawn from no q, their rows are zero."""
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    node = 0
    for k, token in enumerate(chain):
        child = next((c for c in tree.children[node] if tokens[c] == token), None)
        if child is None:  # the rest is new: a chain below `node`
            first = len(tokens)
            for j, rest in enumerate(chain[k:]):
                tokens.append(rest)
                parents.append(node if j == 0 else len(tokens) - 2)
            if tree.draft_probs is None:
                return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)
            probs = tree.draft_probs
            probs = torch.cat([probs, probs.new_zeros(len(tokens) - first, probs.shape[1])])
            return DraftTree(torch.tensor(tokens, dtype=torch.long), parents, probs,
                             tree.fixed | frozenset(range(first, len(tokens))))
        node = child
    return tree


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share before their first difference. A lookup chain's accepted
    tokens are its common prefix with what the step emitted (the accepted path and the token after it):
    greedy verification accepts the chain's tokens while they are the target's, whichever node held them."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
