"""Context lookup: a draft chain copied from the sequence itself, merged into the drafter's tree.

Where the last few tokens of a sequence occurred before in it (prompt or answer), the tokens that
followed that occurrence are a draft that costs no forward: quoted input (extraction, summaries,
code edits), lists and repeated phrasing, and the loops a small target falls into at greedy
decoding. The drafter predicts these too, but never deeper than its shape; a lookup chain can run
as far as the repetition does. The chain is merged into the drafter's tree by prefix (a lookup
token the drafter also proposed shares its node), so greedy verification accepts the longer of
the two paths and the drafter's own acceptance is never lost; what the lookup costs is its extra
verify rows. Its length adapts to how much the previous chain had accepted (2 * accepted + 2; 4
after a step that found no match), so outside a repetition it adds a row or two. Where the chain alone is
priced to win more per second than the tree with it, a solo greedy stream verifies the chain alone
(decode/fallback.py: StreamMonitor.chain_alone). With no drafter the
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


CHAIN_MEMORY = 512  # ticks (a server's rounds, a stream's steps) over which a learned outcome fades (by 1/e)


def faded_by(ticks: int) -> float:
    """What an outcome learned `ticks` ago still weighs (CHAIN_MEMORY)."""
    return (1 - 1 / CHAIN_MEMORY) ** ticks


class ChainAcceptance:
    """How far copied chains get: p_j(L), the acceptance of a chain's j-th token given the ones before it, learned
    from verified chains per sampling regime and found length L (ContextLookup's adaptive length: 2 after a miss,
    16 deep in a repetition; pooled over it, the many short chains after misses would price a long repetition's
    chain as a miss). Each outcome fades over CHAIN_MEMORY ticks toward the Beta(1, 1) prior, so traffic that
    changed is followed, and a length that stopped being verified is offered again in time."""

    def __init__(self):
        self.rounds = 0  # ticks
        # (greedy, found length) -> [tick of the last update, [per position: weight of chains that reached it,
        # of those that accepted it]]
        self.counts: dict[tuple[bool, int], list] = {}

    def tick(self) -> None:
        self.rounds += 1

    def _faded(self, greedy: bool, found: int) -> list[list[float]]:
        entry = self.counts.setdefault((greedy, found), [self.rounds, [[0.0, 0.0] for _ in range(found)]])
        fade = faded_by(self.rounds - entry[0])
        if fade != 1:
            entry[1] = [[reached * fade, accepted * fade] for reached, accepted in entry[1]]
            entry[0] = self.rounds
        return entry[1]

    def positions(self, greedy: bool, found: int) -> list[list[float]]:
        """Per position of a chain found `found` long, the faded weights [reached, accepted] (a copy)."""
        return [list(p) for p in self._faded(greedy, found)]

    def keep(self, greedy: bool, found: int, positions: list[list[float]]) -> None:
        """Take up `positions` (as `positions` returned them, e.g. in an earlier process) as learned now."""
        if len(positions) != found or any(len(p) != 2 or min(p) < 0 or p[1] > p[0] for p in positions):
            raise ValueError(f"chain counts for length {found} do not fit it")
        self.counts[(greedy, found)] = [self.rounds, [[float(r), float(a)] for r, a in positions]]

    def acceptance(self, greedy: bool, found: int, position: int) -> float:
        """p of the `position`-th token (1-based) of a chain found `found` long, given the ones before it."""
        reached, accepted = self._faded(greedy, found)[position - 1]
        return (accepted + 1) / (reached + 2)

    def expected_by_offered(self, greedy: bool, found: int) -> list[float]:
        """E[tokens accepted] of the first n tokens of a chain found `found` long, for n = 0..found."""
        totals, run = [0.0], 1.0
        for k in range(1, found + 1):
            run *= self.acceptance(greedy, found, k)
            totals.append(totals[-1] + run)
        return totals

    def learn(self, greedy: bool, found: int, offered: int, accepted: int) -> None:
        """Of a chain found `found` long, the first `offered` tokens were verified and `accepted` accepted."""
        counts = self._faded(greedy, found)
        for k in range(1, min(offered, accepted + 1) + 1):  # positions the verifier reached
            counts[k - 1][0] += 1
            counts[k - 1][1] += accepted >= k


class ChainPlanner(ChainAcceptance):
    """How many copied tokens every row of a batched round verifies, when the rows draft copied chains alone
    (prompt lookup in a server: `anchorspec serve --lookup` with no drafter). One row's chain pads every row
    of the forward to its width, so a round caps all chains at the length c that gives the most expected
    tokens per second:

        rate(c) = (B + sum_i E[accepted | chain of L_i found, min(L_i, c) offered]) / forward(B, c + 1)

    over c = 0 (a plain round) and the rows' chain lengths L_i, where forward(rows, width) is the target
    forward's measured cost (`cost`, e.g. ForwardCosts.between_widths; None where unmeasured) and E[accepted | L, n] =
    sum_{k<=n} prod_{j<=k} p_j(L), learned from this server's verified chains (ChainAcceptance; a tick a round).
    A round that cannot be priced (no cost measured at its rows' widths) verifies every chain whole, as prompt
    lookup alone does."""

    def __init__(self, cost):
        super().__init__()
        self.cost = cost

    def cap(self, rows: int, chains: list[tuple[bool, int]]) -> int:
        """The round's cap on copied tokens: `rows` in the forward, `chains` (greedy, found length) of those that
        found one."""
        self.tick()
        plain = self.cost(rows, 1)
        best, best_rate = 0, (rows / plain if plain else 0.0)
        expected = [(found, self.expected_by_offered(greedy, found)) for greedy, found in chains]
        for c in sorted({found for _, found in chains}):
            seconds = self.cost(rows, c + 1)
            if seconds is None or not plain:
                return max(found for _, found in chains)  # unpriced: every chain whole
            gain = rows + sum(totals[min(found, c)] for found, totals in expected)
            if gain / seconds > best_rate:
                best, best_rate = c, gain / seconds
        return best
