"""Adaptive speculation: change the draft depth during a generation from recent acceptance.

An integral controller on depth (HF assisted generation's `num_assistant_tokens` heuristic, for
trees): after a verified draft of depth d with a tokens accepted,

    a == d       everything was accepted: the drafter is on a run, go one deeper
    a <  d - 1   two or more levels were wasted: go one shallower
    otherwise    keep d

so depth settles where a full accept is as frequent as two wasted levels. Trees keep their top_k and
scale their node budget with depth (the base shape's nodes per level). One controller per
generation: its state is that sequence's recent acceptance.
"""

from __future__ import annotations

from ..errors import AnchorspecError
from .tree import TreeShape


class AdaptiveDepth:
    def __init__(self, base: TreeShape, min_depth: int = 1, max_depth: int | None = None):
        max_depth = max_depth if max_depth is not None else base.depth + 2
        if not 1 <= min_depth <= base.depth <= max_depth:
            raise AnchorspecError(f"adaptive depth needs 1 <= min_depth <= {base.depth} <= max_depth, "
                                  f"got {min_depth}, {max_depth}")
        self.base, self.min_depth, self.max_depth = base, min_depth, max_depth
        self.depth = base.depth
        self.history: list[int] = []  # the depth used at each step (for reports and tests)

    def shape(self) -> TreeShape:
        d = self.depth
        if self.base.is_chain:
            return TreeShape.chain(d)
        per_level = (self.base.total_tokens - 1) / self.base.depth
        total = max(d + 1, min(round(1 + per_level * d), 1 + self.base.top_k + (d - 1) * self.base.top_k ** 2))
        return TreeShape(self.base.top_k, d, total)

    def observe(self, drafted_depth: int, accepted: int) -> None:
        self.history.append(drafted_depth)
        if drafted_depth < self.depth:  # a draft cut short by the token budget says nothing about depth
            return
        if accepted >= drafted_depth:
            self.depth = min(self.depth + 1, self.max_depth)
        elif accepted < drafted_depth - 1:
            self.depth = max(self.depth - 1, self.min_depth)
