"""Adaptive speculation: change the draft depth during a generation from recent acceptance.

Two controllers, one interface (`shape()` before a step, `observe()` after it):

`AdaptiveDepth` (`--depth-control step`, alias `--adaptive`) is an integral controller on depth (HF assisted generation's `num_assistant_tokens` heuristic, for
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


# PID gains and setpoint. The setpoint is the share of a draft's levels that should be accepted: a
# level is worth drafting while its chance of acceptance beats what it costs, and on a CPU one more
# level costs a drafter pass plus a wider verify, together about half of what an accepted token
# saves (`anchorspec tune` measures 0.2-0.3 of a step per drafter pass and 1.2-1.4x a step for a
# 16-token verify), so depth should grow while more than half the levels are accepted.
PID_SETPOINT = 0.5
# (Kp, Ki, Kd) in levels per unit of error. Ki = 2: a draft fully accepted (error +0.5) or fully
# rejected (-0.5) moves depth one level per step, as the step rule does; Kp and Kd add a jump when
# the accepted share changes (prose into code) and damp it when the change reverses.
PID_GAINS = (1.0, 2.0, 0.5)


class PIDDepth(AdaptiveDepth):
    """`--depth-control pid`: depth driven by a PID loop on the accepted share of each draft.

    The error of a step is  accepted / drafted_depth - setpoint;  a continuous depth x moves by the
    velocity form of PID,  Kp (e - e1) + Ki e + Kd (e - 2 e1 + e2),  and the depth used is x rounded
    and clamped to [min_depth, max_depth] (x is clamped too, so no wind-up past the bounds). Unlike
    the step rule it moves by more than one level when acceptance changes sharply (prose into code),
    and it holds its depth while the accepted share sits at the setpoint."""

    def __init__(self, base: TreeShape, min_depth: int = 1, max_depth: int | None = None,
                 setpoint: float = PID_SETPOINT, gains: tuple[float, float, float] = PID_GAINS):
        super().__init__(base, min_depth, max_depth)
        if not 0 < setpoint < 1:
            raise AnchorspecError(f"PID setpoint must be in (0, 1), got {setpoint}")
        if any(g < 0 for g in gains) or len(gains) != 3:
            raise AnchorspecError(f"PID gains must be three non-negative numbers, got {gains}")
        self.setpoint, self.gains = setpoint, tuple(gains)
        self.x = float(self.depth)
        self.errors = [0.0, 0.0]  # the two previous errors (e1, e2)
        self.trace: list[tuple[int, float, float]] = []  # (drafted depth, accepted share, x after) per step

    def observe(self, drafted_depth: int, accepted: int) -> None:
        self.history.append(drafted_depth)
        if drafted_depth < self.depth:  # cut short by the token budget: says nothing about depth
            return
        share = min(accepted, drafted_depth) / drafted_depth
        e = share - self.setpoint
        e1, e2 = self.errors
        kp, ki, kd = self.gains
        self.x += kp * (e - e1) + ki * e + kd * (e - 2 * e1 + e2)
        self.x = min(max(self.x, self.min_depth), self.max_depth)
        self.errors = [e, e1]
        self.depth = int(round(self.x))
        self.trace.append((drafted_depth, share, self.x))


DEPTH_CONTROLS = {"step": AdaptiveDepth, "pid": PIDDepth}


def depth_controller(name: str | None, base: TreeShape) -> TreeShape | AdaptiveDepth:
    """The shape policy of one generation: the fixed ``base`` (None or "fixed"), or a fresh controller."""
    if name in (None, "fixed"):
        return base
    if name not in DEPTH_CONTROLS:
        raise AnchorspecError(f"unknown depth control {name!r}; choose fixed, {', '.join(DEPTH_CONTROLS)}")
    return DEPTH_CONTROLS[name](base)
