"""Drift fallback: stop speculating for a request whose drafter no longer pays, retry later.

Break-even, from the server's own measured round costs. All running sequences share each round:
one drafting pass per draft level over the B drafting sequences, then one target forward over all B
rows padded to the widest (a tree of W nodes; a plain row is 1 token). So with B sequences

    speculating costs  c_spec  = drafting(B) + forward(B, W)  per round and yields tau tokens per sequence,
    plain costs        c_plain = forward(B, 1)                  per round and yields 1 token per sequence,

and speculation is faster while tau > tau*(B) = c_spec / c_plain. At B = 1 this is the batch-1
break-even (t_draft + t_verify) / t_plain. Under load it rises where a forward's cost grows with
the tokens it computes (a CPU; a GPU at large B): the B * (W - 1) extra tokens are no longer
nearly free, and plain rows padded next to a tree pay for them too.

forward(rows, width) (ForwardCosts: a curve over rows per padded width) and drafting(rows) are
cost curves (CostCurve: per bucket of the work, the median of its latest ROUND_COST_WINDOW rounds,
interpolated) learned from every round the scheduler reports (`observe_round`: rows, padded width and
wall time of each batched forward, drafting rows and wall time) except those that paid a one-off (a
graph compiled, a KV cache grown: decode/batch.one_offs), seeded by a short calibration at start-up.
B is the row count of the latest round; W the width of the latest drafting round.
A fixed `threshold` overrides tau*.

Per request: the rolling mean of the last `window` accepted lengths (accepted + 1, EAGLE's tau).
Once at least `min_steps` are in the window and it falls below tau* (judged_tau: the mean plus one
standard error; a stream's shrunk toward its long-run tau first, PRIOR_STEPS), the request switches to
plain decoding; after `retry_after` plain tokens it is due to speculate again with an empty
window, which it does at the next retry round (every `retry_after` rounds, all due requests
together: see `start_round`).
Globally: the same rolling tau over the last `global_window` steps of all requests, judged once it
holds `global_min_steps`; while it is below tau*, new requests start in plain mode and are due for
a retry at once (they probe at the next retry round, which keeps the global window fresh), so a
drafter that stops fitting the traffic stops costing every new request its first `min_steps` steps.
Per round (`round_plan`): rows switched off ride along in a speculative round (a tree pads every
row anyway), so a batched round speculates only while the accepted lengths in its rows' windows,
pooled, average at least tau*(B) (SWITCH_ON_MARGIN above it to turn rows on that were off: each first catches up);
a round that decides plain switches its rows off and forgets their
windows (`veto`). While the batch is learning (a probe, new requests, too few pooled lengths) only
the rows switched on speculate, in a target forward apart from the plain rows', when the cost
curves say that loses less time against plain rounds than padding every row; a probe of a plain batch
retries at most `min_steps` rows (the most overdue first), the evidence one round needs, when
their forward apart pays.
Probes back off: a retry round is skipped while the global tau sits more than `PROBE_MARGIN` below
tau* at the current batch size, up to `max_retry_after` rounds since the last probe, a wait that each
such forced probe doubles (up to 2**PROBE_DOUBLINGS times) until a retry round finds tau closer. A probe that
such a wide margin says will fail costs a speculative round at a loss, and the drafter's catch-up on
every row's missed features, for nothing (session 33: at 16 users a speculative round cost ~4.7
plain rounds for ~2 tokens a row, and such rounds were all a drafter server lost to a plain one).
The forward apart (session 34) is what makes a probe at 16 users cheap: a few rows draft, catch
up and verify while the others take their plain step, instead of all of them.
A server may choose each round's draft shape among several (`shapes`, `shape_for_rows`): each shape's drafting
curve and width are its own, the drafter's acceptance per depth is learned from the speculative steps as a stream's
is (below), and a round of B rows drafts the shape whose expected tau over its tau*(B) is best; while a shape is
tracked, windows and the pooled lengths are judged shrunk toward its long-run tau (judged_tau, pooled_tau), and a
new request joining a batch at which no shape is expected to pay starts plain before any window can say so.

Lossless either way (plain steps are verified target tokens). Seeded sampling stays
reproducible only while no switch happens: a switch changes how the random stream is consumed.

One stream (`generate`, the Python API, `bench`: StreamMonitor) is the same policy at B = 1, priced
per step instead of per round: verify(N) is the wall time of a whole step that verifies N tokens
(N = 1: a plain step; verification, commit and bookkeeping included, since a plain step pays them
too), draft(d) the drafting of a depth-d draft (of each candidate tree, its own). They are seeded
by a few timed forwards (`calibrate`) and learned from every step. The same curves choose the
starting draft shape when none was tuned or given (`StreamMonitor.choose_shape`): the chain depth,
or the candidate tree (TREE_CANDIDATES), whose expected tokens per second beats plain decoding by
the most; if none does, the stream starts plain and retries like any other. A chain's tau comes
from the acceptance per depth learned from this process's verified steps (a prior before that); a
tree's from its top-1 chain's, scaled by what the tree's own steps accepted beyond that chain.
The calibration's figures are guesses that the first real step of that size replaces, and a measured
shape is checked against the other candidates as it runs: every EXPLORE_EVERY steps one step drafts
the plausible candidate drafted least recently (`StreamMonitor.explore`), so that a shape left early
on noisy costs is priced again from real steps. A stream's costs are relative, not seconds: each
step's time is divided by the stream's pace (how much slower than usual its own shape's recent steps
ran: PACE_WINDOW), so that a candidate explored while the host runs slow is not priced as slow.
Acceptance (per depth, per tree) and the global window are kept per sampling regime, greedy and
sampled (`StreamMonitor.select`; REGIMES' comment): a sampled stream is priced and judged on what
sampled steps accepted, not on a blend with greedy ones. The costs are shared.
With a context lookup (decode/lookup.py), a greedy stream's speculating step whose lookup found a chain verifies
that chain alone, with no drafter pass, where the chain's expected tokens over its verify beat the drafter's tree
with the chain merged, over drafting and the wider verify (`StreamMonitor.chain_alone`, ChainChoice: what chains
of each found length win alone and what the tree adds beside them, learned from this process's steps).
What a stream learned (`StreamMonitor.state`) outlives its process: `anchorspec.load` keeps it per
target, drafter, dtype and machine (decode/shape.py: costs_path), so the next run starts from real
steps' costs and the drafter's measured acceptance instead of a short, noisy calibration.
"""


from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from ..errors import AnchorspecError
from .lookup import ChainAcceptance, faded_by
from .sampling import SamplingParams
from .shape import verify_cost
from .tree import TreeShape


# Acceptance (a stream's, per depth and per tree) and the global window that gates new requests are kept
# apart per sampling regime: greedy steps accept more than sampled ones (round 24 on MT-bench: tau 2.24 at
# T=0, 1.79 at T=1, session 72), and a stream's costs file outlives processes, so with one set the first
# sampled run after many greedy ones was priced on greedy acceptance and its window judged shrunk toward
# greedy's tau (a sampled stream whose drafts all failed never switched off: tests/test_fallback.py). Sampled
# temperatures share one set (a set per temperature would leave each on its prior). Costs are shared.
GREEDY, SAMPLED = "greedy", "sampled"
REGIMES = (GREEDY, SAMPLED)


def regime_of(sampling: SamplingParams) -> str:
    return GREEDY if sampling.greedy else SAMPLED


@dataclass
class RequestState:
    window: deque = field(default_factory=deque)  # accepted lengths (accepted + 1) of recent steps
    speculating: bool = True
    plain_left: int = 0  # plain tokens still to go before speculation is retried
    switches: int = 0
    regime: str = GREEDY  # its steps feed this regime's global window

    @property
    def rolling_tau(self) -> float | None:
        return sum(self.window) / len(self.window) if self.window else None

    def upper_tau(self, standard_errors: float) -> float | None:
        """The highest tau the window still plausibly comes from: its mean plus `standard_errors` (the
        monitor's, 1 by default; 0 is the rule before session 46) standard errors.
        A switch off waits until even that is below tau*: four steps of a drafter at tau 2.6 average
        below tau* ~1.7 often enough by chance (accepted lengths of 1 and 2 come in runs) that, with the
        cheap AOT-compiled step, `generate` spent half its steps plain on MT-bench, at 0.85x of always
        speculating (session 46). A drafter that never fits (every length 1) has no spread: it still
        switches off after `min_steps`."""
        n = len(self.window)
        if not n:
            return None
        mean = sum(self.window) / n
        spread = (sum((x - mean) ** 2 for x in self.window) / (n - 1)) ** 0.5 if n > 1 else 0.0
        return mean + standard_errors * spread / n ** 0.5


EXACT_UP_TO = 16  # work up to this has a bucket per value: small GEMMs' costs jump between sizes


def cost_bucket(x: float) -> int:
    """Work 1..16 each its own bucket; above, one per power of two (17-31, 32-63, ...). A CPU forward
    of 2 or 3 tokens can cost more than one of 4 (SmolLM2 in fp32 here: 1.66x and 2.03x a 1-token
    step, 4 tokens 1.49x; docs/results.md, session 23), so the sizes a chain verifies are not
    interpolated from their neighbours."""
    x = int(x)
    return x if x <= EXACT_UP_TO else EXACT_UP_TO + x.bit_length()


class CostCurve:
    """Cost y of work x (padded tokens, drafting rows), learned per bucket of x (cost_bucket): each
    bucket keeps exponential moving averages of its x and y, and a prediction interpolates
    linearly between the neighbouring buckets' points (beyond the ends: the end segment's slope,
    or flat with one bucket). Buckets are remembered separately, so hours at batch 16 do not
    make the server forget what a batch-1 step costs. Between two measured points cost never falls
    (a falling segment is flat); a measured point is its own cost, even below a smaller one's."""

    def __init__(self, smoothing: float, window: int | None = None):
        """`window`: each bucket's point is the median of its last `window` samples, not a moving
        average (a stream's: see COST_WINDOW)."""
        self.smoothing = smoothing
        self.window = window
        self.points: dict[int, list[float]] = {}  # bucket -> [mean x, mean y] (with a window: medians)
        self.provisional: set[int] = set()  # buckets whose point came from a calibration, not real work
        self.samples: dict[int, deque] = {}  # bucket -> its last `window` real (x, y) (with a window)

    def add(self, x: float, y: float, provisional: bool = False) -> None:
        """Learn that work x cost y. `provisional`: a calibration's figure, which the first real one
        replaces instead of being averaged with (a few timed forwards in a fresh process are a guess)."""
        bucket = cost_bucket(x)
        point = self.points.get(bucket)
        if point is None or bucket in self.provisional:
            self.points[bucket] = [float(x), float(y)]
            self.provisional.discard(bucket)
            if provisional:
                self.provisional.add(bucket)
            if self.window:
                self.samples[bucket] = deque([] if provisional else [(float(x), float(y))], maxlen=self.window)
        elif self.window:  # a point restored from a costs file counts as one sample
            recent = self.samples.setdefault(bucket, deque([tuple(point)], maxlen=self.window))
            recent.append((float(x), float(y)))
            point[0] = statistics.median(a for a, _ in recent)
            point[1] = statistics.median(b for _, b in recent)
        else:
            point[0] += self.smoothing * (x - point[0])
            point[1] += self.smoothing * (y - point[1])

    def restore(self, points, guessed: set[int]) -> None:
        """Take up (x, y) `points` an earlier process kept, those in `guessed` buckets as provisional."""
        self.samples.clear()
        for x, y in points:
            self.points[cost_bucket(x)] = [x, y]
        self.provisional = guessed & set(self.points)

    def __call__(self, x: float) -> float | None:
        if not self.points:
            return None
        own = self.points.get(cost_bucket(x))
        if own is not None and own[0] == x:  # a measured point is its own cost, even below a smaller x's: a slow
            # first round at 12 rows (96 ms) had made 16 rows' (41 ms) cost 96 as the end of a falling segment (s81)
            return own[1]
        pts = [self.points[b] for b in sorted(self.points)]
        if len(pts) == 1:
            return pts[0][1]
        i = next((k for k in range(1, len(pts) - 1) if x < pts[k][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 != x0 else 0.0
        return max(y0 + slope * (x - x0), 0.0)


class ForwardCosts:
    """A batched target forward's time by (rows, padded width): one CostCurve over rows per width.
    Not one curve over padded tokens: a forward's cost is not its tokens' alone, each row also reads
    its own KV cache, so 16 plain rows (16 tokens) cost 1.0-1.6x what one row's 16-node tree does
    (two traced load runs, bf16, 1 thread, SmolLM2-135M). On one curve the two shared a point, and a
    burst of 16 users' plain rounds priced the next lone request's 16-token verify at their cost."""

    def __init__(self, smoothing: float, window: int | None = None):
        """`window`: each point is the median of its last `window` samples (CostCurve), else a moving average."""
        self.smoothing, self.window = smoothing, window
        self.curves: dict[int, CostCurve] = {}  # padded width -> cost over rows

    def add(self, rows: int, width: int, seconds: float) -> None:
        self.curves.setdefault(width, CostCurve(self.smoothing, self.window)).add(rows, seconds)

    def __call__(self, rows: int, width: int) -> float | None:
        curve = self.curves.get(width)
        return None if curve is None else curve(rows)

    def between_widths(self, rows: int, width: int) -> float | None:
        """forward(rows, width), interpolated linearly between the nearest measured widths on either side
        when `width` itself was not measured (None beyond the widest or below the narrowest): copied chains
        come in every length, and a server cannot measure each width before pricing it."""
        if width in self.curves:
            return self(rows, width)
        below = max((w for w in self.curves if w < width), default=None)
        above = min((w for w in self.curves if w > width), default=None)
        if below is None or above is None:
            return None
        lo, hi = self(rows, below), self(rows, above)
        return lo + (hi - lo) * (width - below) / (above - below)


def at_least(verify: float, plain: float) -> float:
    """A verify's cost for the break-even: never below the plain step it contains. On a CPU with AMX
    one token and a few cost the same GEMM time, and noise put verify(2) under verify(1): tau* fell
    below 1 and a random drafter (tau 1.00) speculated whole prompts at 0.87x of plain (session 27)."""
    return max(verify, plain)


@dataclass
class Acceptance:
    """What one regime's verified drafts taught: per depth d, the drafts that reached d with d - 1
    accepted and those whose depth-d token was accepted; per tree shape, [steps, accepted, accepted
    by its top-1 chain]."""
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    trees: dict[str, list[int]] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"reached": list(self.reached), "accepted": list(self.accepted),
                "trees": {k: list(v) for k, v in self.trees.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Acceptance":
        """Raises ValueError (or the parse errors restore() catches) on counts no state could hold."""
        reached, accepted = [int(n) for n in data["reached"]], [int(n) for n in data["accepted"]]
        trees = {shape_key(TreeShape.parse(k)): [int(n) for n in v] for k, v in data["trees"].items()}
        if (len(reached) != len(accepted) or any(a > r or a < 0 for a, r in zip(accepted, reached))
                or any(len(v) != 3 or min(v) < 0 for v in trees.values())):
            raise ValueError("inconsistent acceptance counts")
        return cls(reached, accepted, trees)


def _selected(name: str, doc: str) -> property:
    """A monitor attribute that is the selected regime's Acceptance field `name`."""
    return property(lambda self: getattr(self.learned[self.regime], name),
                    lambda self, value: setattr(self.learned[self.regime], name, value), doc=doc)


def shape_key(shape: TreeShape) -> str:
    return f"{shape.top_k},{shape.depth},{shape.total_tokens}"


PROBE_MARGIN = 0.1  # retries are skipped while the global tau is this far (relative) below tau*
PROBE_BACKOFF = 8  # ... but at least every PROBE_BACKOFF * retry_after rounds: the traffic may have changed
# Each such forced probe doubles the wait for the next one, up to 2**PROBE_DOUBLINGS times max_retry_after, until a
# retry round finds the global tau no longer that far below (the wait is then max_retry_after again). A probe at 16
# rows costs ~2.8 plain rounds (4 rows drafting and verifying apart, their drafters first reading every position
# since the last: 157 ms against 56, session 77), every 256 rounds on steady traffic where speculation cannot pay.
PROBE_DOUBLINGS = 4
# A batched round turns its switched-off rows on (round_plan) only where the pooled accepted lengths beat tau*(B) by
# this much; once on, tau*(B) itself keeps it on. Switching on costs every such row's drafter a catch-up on the
# positions it missed: a 16-row round after a plain stretch took 200-380 ms against ~55 for a plain one (AMX Xeon,
# bf16, 1 thread, session 82), which rounds at the break-even never win back.
SWITCH_ON_MARGIN = 0.1
# A server prices a speculative round's forward and drafting at the plain round's cost now: each was measured when a
# plain round of as many rows cost plain_then, and is scaled by forward(rows, 1) / plain_then. A round's cost grows
# with its rows' contexts, and plain rounds are measured all the time while a batch that does not speculate measures
# wide ones only at start-up: at 16 users plain rounds went from the calibration's 44 ms to 65-70 ms in MT-bench
# traffic while the chains' rounds kept their calibrated ~120 ms, so a chain of 3 was priced at tau* 1.8 where its
# rounds cost 2.9 plain ones (AMX Xeon, bf16, 1 thread, session 82); calibrated, the ratio was 2.7: ratios held where
# absolute costs did not.
FOLLOW_PACE = True
# A server's round costs are the median of each bucket's last ROUND_COST_WINDOW rounds, as a stream's steps are
# (COST_WINDOW), not a moving average: one 1.1 s round at 16 rows (a cache grown mid-round, before one_offs) moved
# a 0.1 average of 63 ms plain rounds to 165 ms, and twenty rounds later it still priced them at 106 ms, a chain
# of 2 at tau* 1.12 where it cost 2x a plain round: the server speculated at a loss for the rest of the run
# (AMX Xeon, bf16, 1 thread, session 82). The same 9 as a stream's: enough for one slow round in four to leave the
# median alone, few enough to follow the host within a few rounds.
ROUND_COST_WINDOW = 9


class DriftMonitor:
    def __init__(self, window: int = 16, min_steps: int = 4, retry_after: int = 32, global_window: int = 128,
                 threshold: float | None = None, enabled: bool = True, smoothing: float = 0.1,
                 global_min_steps: int = 32, max_retry_after: int | None = None,
                 round_cost_window: int | None = ROUND_COST_WINDOW):
        """`round_cost_window`: a round cost is the median of its bucket's last that many rounds (None: a moving
        average with `smoothing`, the rule before session 82)."""
        max_retry_after = PROBE_BACKOFF * retry_after if max_retry_after is None else max_retry_after
        if not (window >= 1 and 1 <= min_steps <= window and 1 <= retry_after <= max_retry_after
                and global_window >= 1 and 1 <= global_min_steps):
            raise ValueError("need window >= min_steps >= 1, max_retry_after >= retry_after >= 1, "
                             "global_window >= 1, global_min_steps >= 1")
        self.window, self.min_steps, self.retry_after = window, min_steps, retry_after
        self.max_retry_after = max_retry_after
        self.last_probe = 0  # the round of the latest retry
        self.probes_skipped = 0
        self.futile_probes = 0  # probes forced in a row while the global tau stayed far below tau* (probe_wait)
        self.probe_doublings = PROBE_DOUBLINGS  # 0: a forced probe every max_retry_after rounds (before session 77)
        self.switch_on_margin = SWITCH_ON_MARGIN  # 0: rows switched on at tau*(B) itself (before session 82)
        # the gate for every new request judges from more steps than one request's switch does: the
        # first few steps of one prompt (a slow start is common) must not turn speculation off for all
        self.global_min_steps = min(global_min_steps, global_window)
        self.fixed_threshold, self.enabled = threshold, enabled
        self.standard_errors = 1.0  # a stream switches off when its window's mean + this many standard errors < tau*
        self.smoothing, self.round_cost_window = smoothing, round_cost_window
        self.forward = ForwardCosts(smoothing, round_cost_window)
        # what a plain round of as many rows cost when each wider forward and each drafting round was measured
        # (forward(rows, 1) then): a price is scaled by how much plain rounds have slowed since (FOLLOW_PACE)
        self.plain_then = ForwardCosts(smoothing, round_cost_window)
        self._drafting_plain_then: dict[str | None, CostCurve] = {}
        self.follow_pace = FOLLOW_PACE
        self.rows = 1  # sequences in the latest round: the B of tau*(B)
        # the draft shape rounds draft with (None: one shape, never chosen); tau*(B) prices its drafting(B), a curve
        # per shape, and its width W (`drafting`, `width`)
        self.shape: TreeShape | None = None
        self._drafting: dict[str | None, CostCurve] = {}
        self._latest_width: int | None = None  # the padded width of the latest round that drafted
        self.shapes: tuple[TreeShape, ...] = ()  # the shapes a server chooses among per round (shape_for_rows)
        # with a shape tracked, windows are judged shrunk toward its long-run tau as if this many more steps had come
        # in at it (PRIOR_STEPS' comment); 0: a window judged on its own (the rule before session 56)
        self.prior_steps = PRIOR_STEPS
        # what verified drafts taught of the drafter's acceptance, per sampling regime (REGIMES' comment)
        self.learned: dict[str, Acceptance] = {regime: Acceptance() for regime in REGIMES}
        self.regime = GREEDY
        self.recent: deque = deque(maxlen=global_window)  # every request's steps
        self.recent_by_regime: dict[str, deque] = {regime: deque(maxlen=global_window) for regime in REGIMES}
        self.switches_off = self.switches_on = 0
        self.rounds = 0

    @property
    def _key(self) -> str | None:
        return None if self.shape is None else shape_key(self.shape)

    @property
    def drafting(self) -> CostCurve:
        """drafting(B) of the current shape's rounds."""
        return self._shape_curve(self._drafting)

    def _shape_curve(self, curves: dict[str | None, CostCurve]) -> CostCurve:
        """The current shape's curve of `curves` (a curve per shape key), made on first use."""
        if self._key not in curves:
            curves[self._key] = CostCurve(self.smoothing, self.round_cost_window)
        return curves[self._key]

    @property
    def width(self) -> int | None:
        """The padded width tau*(B) prices: the latest drafting round's (None: none yet); with a shape tracked, the
        shape's own (its rounds' trees, not one cut short near a token limit or widened by a lookup chain)."""
        return self.shape.total_tokens if self.shape is not None else self._latest_width

    @width.setter
    def width(self, value: int) -> None:
        self._latest_width = value

    # --- costs ----------------------------------------------------------------------------------
    def observe_round(self, rows: int, width: int, forward_s: float, draft_rows: int = 0,
                      draft_s: float = 0.0, catch_up: bool = False, forwards=None) -> None:
        """One round: `rows` sequences padded to `width` tokens in a forward of `forward_s`, and
        `draft_rows` of them drafting for `draft_s` (0 rows: no drafting). `forwards`: the round's
        target forwards as (rows, width, seconds) when it ran more than one (plain rows apart from
        speculating ones); `rows` is then all of them, `width` the widest. `catch_up`: the drafters
        first read the features of a plain stretch (all its positions, in every row), a one-off of
        switching on that is not what a speculative round costs: its drafting time is not learned
        (session 33: with them the mean tau*(16) a server priced reached 5.0 in one load test; steady
        rounds put it at 2.1)."""
        if rows:
            self.rows = rows
            for f_rows, f_width, seconds in forwards or [(rows, width, forward_s)]:
                if f_width > 1 and (plain := self.forward(f_rows, 1)):
                    self.plain_then.add(f_rows, f_width, plain)
                self.forward.add(f_rows, f_width, seconds)
        if draft_rows:
            if not catch_up:
                self.drafting.add(draft_rows, draft_s)
                if plain := self.forward(draft_rows, 1):
                    self._shape_curve(self._drafting_plain_then).add(draft_rows, plain)
            self.width = width

    def _paced(self, cost: float | None, then: float | None, rows: int) -> float | None:
        """`cost`, measured when a plain round of `rows` rows cost `then`, at what a plain round costs now."""
        now = self.forward(rows, 1)
        return cost if not self.follow_pace or cost is None or not then or not now else cost * now / then

    def verify_cost(self, rows: int, width: int) -> float | None:
        """forward(rows, width), paced (FOLLOW_PACE)."""
        return self._paced(self.forward(rows, width), self.plain_then(rows, width), rows)

    def drafting_cost(self, rows: int, shape: TreeShape | None = None) -> float | None:
        """drafting(rows) of `shape` (None: the current shape), paced (FOLLOW_PACE)."""
        key = self._key if shape is None else shape_key(shape)
        curve, then = self._drafting.get(key), self._drafting_plain_then.get(key)
        return None if curve is None else self._paced(curve(rows), then and then(rows), rows)

    def threshold_at(self, rows: int, shape: TreeShape | None = None) -> float | None:
        """tau*(rows) (see the module docstring) of drafting with `shape` (None: the current shape); None until
        both round kinds have been measured."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        shape = shape or self.shape
        width = self.width if shape is None else shape.total_tokens
        if width is None:
            return None
        plain, verify, drafting = self.forward(rows, 1), self.verify_cost(rows, width), self.drafting_cost(rows, shape)
        if not plain or verify is None or drafting is None:
            return None
        return (drafting + at_least(verify, plain)) / plain

    def expected_speedup(self, rows: int, shape: TreeShape) -> float | None:
        """Expected tokens per second of rounds of `rows` rows drafting with `shape` over plain rounds, on the cost
        curves and the selected regime's acceptance (expected_shape_tau); None while a cost is unknown."""
        tstar = None if self.fixed_threshold is not None else self.threshold_at(rows, shape)
        return None if tstar is None else self.expected_shape_tau(shape) / tstar

    def shape_for_rows(self, rows: int, shapes) -> TreeShape | None:
        """Of `shapes`, the one expected fastest in a round of `rows` rows (expected_speedup; shapes not priced yet
        are passed over); the current shape stays unless another is expected SHAPE_MARGIN faster. A round's width
        costs more the more rows it has (16 rows of a 16-node tree: 4.4x a plain round on the AMX Xeon, bf16,
        1 thread, session 81), so a batch's best draft is shallower than a lone request's."""
        priced = [(value, shape) for shape in shapes if (value := self.expected_speedup(rows, shape)) is not None]
        if not priced:
            return self.shape
        best_value, best = max(priced, key=lambda p: p[0])
        kept = next((value for value, shape in priced if shape == self.shape), None)
        return self.shape if kept is not None and kept * (1 + SHAPE_MARGIN) >= best_value else best

    @property
    def threshold(self) -> float | None:
        """tau* at the current batch size."""
        return self.threshold_at(self.rows)

    def gate_window(self, regime: str | None = None) -> deque:
        """The recent accepted lengths a new request of `regime` is gated on: that regime's (None: every
        request's, what a batch of mixed rows and the server's gauges are judged on)."""
        return self.recent if regime is None else self.recent_by_regime[regime]

    def gate_tau(self, regime: str | None = None) -> float | None:
        """The mean of gate_window(regime) (None while it is empty)."""
        window = self.gate_window(regime)
        return sum(window) / len(window) if window else None

    @property
    def global_tau(self) -> float | None:
        return self.gate_tau()

    def _pays(self, tau: float | None, n: int, min_steps: int | None = None, rows: int | None = None) -> bool:
        tstar = self.threshold if rows is None else self.threshold_at(rows)
        return not self.enabled or tstar is None or n < (min_steps or self.min_steps) or tau >= tstar

    @property
    def global_speculating(self) -> bool:
        """Whether a new request starts speculating now (at the latest round's batch size)."""
        return self.global_speculating_at()

    def global_speculating_at(self, rows: int | None = None, regime: str | None = None) -> bool:
        """Whether a new request of `regime` (gate_window) joining a batch of `rows` starts speculating
        (None: the latest round's)."""
        if len(self.gate_window(regime)) < self.global_min_steps and not self._might_pay(rows or self.rows, regime):
            return False
        return self._pays(self.gate_tau(regime), len(self.gate_window(regime)), self.global_min_steps, rows)

    def _might_pay(self, rows: int, regime: str | None) -> bool:
        """Before the recent steps can say: whether any of a server's shapes is expected to pay at `rows` rows on
        the costs and the acceptance learned so far (the prior's before any). True with no shapes to choose from,
        or none priced. At 16 rows no draft shape paid on the AMX Xeon (session 81), and a burst of new
        requests that all started speculating cost a round of 16 trees: 285 ms against 42 for a plain one."""
        if not self.shapes or not self.enabled or self.fixed_threshold is not None:
            return True
        if regime is not None:
            self.regime = regime
        values = [value for shape in self.shapes if (value := self.expected_speedup(rows, shape)) is not None]
        return not values or max(values) >= 1

    # --- acceptance -------------------------------------------------------------------------------
    def select(self, sampling: SamplingParams) -> str:
        """Price and judge what follows (shapes, break-even, the global window) on the acceptance that
        steps decoded like `sampling` measured; returns the regime."""
        self.regime = regime_of(sampling)
        return self.regime

    # the selected regime's Acceptance, read and written as the monitor's own
    reached = _selected("reached", "Verified drafts that reached depth d with d - 1 accepted (the selected regime's).")
    accepted = _selected("accepted", "... and whose depth-d token was accepted.")
    trees = _selected("trees", "Tree shape -> [steps, accepted, accepted by its top-1 chain].")

    def learn_acceptance(self, tree: TreeShape | None, depth: int, accepted: int, top_ranked: int | None = None,
                         top_depth: int | None = None) -> None:
        """What a verified draft says of acceptance: a chain of `depth` (`tree` None) accepted `accepted`
        tokens; a tree's step also says what its top-1 chain had accepted (observe_step's arguments)."""
        if tree is not None:
            key = shape_key(tree)
            if top_ranked is None:
                return  # a tree step that does not say what its top-1 chain had accepted teaches nothing
            counts = self.trees.setdefault(key, [0, 0, 0])
            counts[0] += 1
            counts[1] += accepted
            counts[2] += top_ranked
            accepted, depth = top_ranked, top_depth if top_depth is not None else depth  # its top-1 chain's step
        while len(self.reached) < depth:
            self.reached.append(0)
            self.accepted.append(0)
        for d in range(1, depth + 1):
            self.reached[d - 1] += accepted >= d - 1
            self.accepted[d - 1] += accepted >= d

    def acceptance(self, depth: int) -> float:
        """P(the depth-d token is accepted | depth d - 1 was): measured, shrunk toward the prior; a
        depth never reached takes the deepest measured rate (drafts rarely get better with depth)."""
        rate = PRIOR_ACCEPTANCE
        for d in range(1, depth + 1):
            if d <= len(self.reached):
                rate = (PRIOR_ACCEPTANCE * PRIOR_WEIGHT + self.accepted[d - 1]) / (PRIOR_WEIGHT + self.reached[d - 1])
        return rate

    def measured_depth(self) -> int:
        """The deepest draft level whose acceptance rests on at least PRIOR_WEIGHT verified drafts."""
        return max((d for d, n in enumerate(self.reached, start=1) if n >= PRIOR_WEIGHT), default=0)

    def expected_tau(self, depth: int) -> float:
        """1 + sum over d of P(the first d drafted tokens are all accepted), for a chain of `depth`."""
        tau, reach = 1.0, 1.0
        for d in range(1, depth + 1):
            reach *= self.acceptance(d)
            tau += reach
        return tau

    def tree_ratio(self, shape) -> float:
        """A tree's accepted tokens per token its top-1 chain had accepted in the same steps: measured,
        shrunk toward the regime's prior (TREE_CANDIDATES' comment)."""
        steps, accepted, top = self.trees.get(shape_key(shape), (0, 0, 0))
        prior = PRIOR_TREE_RATIO[self.regime]
        return (prior * TREE_PRIOR_WEIGHT + accepted) / (TREE_PRIOR_WEIGHT + top)

    def expected_shape_tau(self, shape) -> float:
        """Expected tokens per step of drafting with `shape`: a chain's from its per-depth acceptance,
        a tree's as its top-1 chain's scaled by `tree_ratio`."""
        chain = self.expected_tau(shape.depth)
        return chain if shape.is_chain else 1 + (chain - 1) * self.tree_ratio(shape)

    # --- per request ----------------------------------------------------------------------------
    def new_request(self, rows: int | None = None, batch_plain: bool = False, regime: str = GREEDY) -> RequestState:
        """A request's state; `regime`: how it decodes (regime_of), whose recent steps gate it. `rows`: the
        batch size it joins (default: the latest round's). Judged at
        the batch it joins: after a burst drained to a few rows, the last round's tau* is a small
        batch's, and a new burst of 16 would all start speculating (session 33: 4 wasted rounds).
        `batch_plain`: every request it joins is switched off. It then waits for the batch's next
        probe (a retry round) rather than learn alone while the global window is short: alone, in a
        forward of its own, it took up to min_steps rounds at ~2x a plain round's time (session 34)."""
        state = RequestState(window=deque(maxlen=self.window), regime=regime)
        if batch_plain or not self.global_speculating_at(rows, regime):
            self._switch_off(state)
            # due at once: it probes at the next retry round. Only speculative steps refresh the global
            # window, so requests shorter than retry_after would otherwise never probe, and one bad
            # stretch would keep speculation off for good (session 31: a server at one user never
            # speculated again after its first request's first steps)
            state.plain_left = 0
        return state

    def record(self, state: RequestState, kind: str, accepted: int = 0, tokens: int = 1) -> str | None:
        """Feed one step (kind "prefill", "speculative" or "plain"); returns "off" on a switch off
        (switches back on happen in start_round)."""
        if kind == "speculative":
            state.window.append(accepted + 1)
            self.recent.append(accepted + 1)
            self.recent_by_regime[state.regime].append(accepted + 1)
            if state.speculating and not self._pays(self.judged_tau(state), len(state.window)):
                self._switch_off(state)
                return "off"
        if kind != "prefill" and not state.speculating:  # a step of a switched-off request (or one riding
            state.plain_left -= tokens  # along in a speculative round): at 0 or below it is due for a retry
        return None

    def judged_tau(self, state: RequestState) -> float | None:
        """The tau a speculating request's window is judged on (below tau* it switches off): its upper tau
        (RequestState.upper_tau); with a shape tracked (a stream's, or a server's that chooses shapes), the window's
        mean shrunk toward that shape's long-run tau (PRIOR_STEPS' comment), plus `standard_errors` of the window's
        own share: n / (n + prior_steps) of its standard error."""
        n = len(state.window)
        if not n or self.shape is None or not self.prior_steps:
            return state.upper_tau(self.standard_errors)
        weight = n / (n + self.prior_steps)
        spread = statistics.stdev(state.window) if n > 1 else 0.0
        return (weight * statistics.fmean(state.window) + (1 - weight) * self.expected_shape_tau(self.shape)
                + self.standard_errors * weight * spread / n ** 0.5)

    def pooled_tau(self, lengths: list[int]) -> float:
        """What a batch's pooled accepted lengths say its rounds' tau is: their mean, shrunk toward the current
        shape's long-run tau like a window (judged_tau) when a shape is tracked. At 4 rows one round's 4 lengths
        judged raw vetoed a chain of 3 expected at 1.18x plain in two rounds of three (session 81)."""
        mean = statistics.fmean(lengths)
        if self.shape is None or not self.prior_steps:
            return mean
        weight = len(lengths) / (len(lengths) + self.prior_steps)
        return weight * mean + (1 - weight) * self.expected_shape_tau(self.shape)

    def start_round(self, states: list[RequestState]) -> list[RequestState]:
        """Call once per scheduler round with the running requests' states; returns those that
        speculate again from this round on. Retries happen together, every `retry_after` rounds:
        in a batch, one speculating row pads every row to its tree's width, so staggered retries
        would make most rounds pay that width for a few probing requests."""
        self.rounds += 1
        if self.rounds % self.retry_after:
            return []
        due = [s for s in states if not s.speculating and s.plain_left <= 0]
        if not due:
            return []
        if self._probe_futile(len(states)):
            if self.rounds - self.last_probe < self.probe_wait():
                self.probes_skipped += 1
                return []
            self.futile_probes += 1
        else:
            self.futile_probes = 0
        self.last_probe = self.rounds
        on = sum(s.speculating for s in states)
        if self._split_pays(len(states), max(on, min(on + len(due), self.min_steps))):
            # a probe that runs apart: min_steps rows (those on count) are evidence enough, the most overdue
            due = sorted(due, key=lambda s: s.plain_left)[:max(0, self.min_steps - on)]
        for state in due:
            state.speculating, state.window = True, deque(maxlen=self.window)
            state.switches += 1
            self.switches_on += 1
        return due

    def probe_wait(self) -> int:
        """Rounds between forced probes while they stay futile: max_retry_after, doubled by each futile probe
        in a row (PROBE_DOUBLINGS' comment)."""
        return self.max_retry_after * 2 ** min(self.futile_probes, self.probe_doublings)

    def _probe_futile(self, rows: int) -> bool:
        """Whether the recent speculative steps of all requests put tau so far below tau*(rows) that a
        probe now would only confirm it (see the module docstring)."""
        tstar, tau = self.threshold_at(rows), self.global_tau
        return (self.enabled and tstar is not None and len(self.gate_window()) >= self.global_min_steps
                and tau < (1 - PROBE_MARGIN) * tstar)

    def round_plan(self, states: list[RequestState], probing: bool = False) -> list[bool]:
        """Which rows of a batched round speculate. One speculating row pads every row of a forward to
        its tree's width, so the rows switched off ride along (they draft too) and the round is
        all-speculative or all-plain: it costs tau*(B) plain rounds and yields the rows' accepted
        lengths summed. So it speculates while the accepted lengths in the rows' windows, pooled,
        average at least tau*(B), not while any one row's do: at 16 users a lucky window in one row
        kept every round speculating at the break-even (session 31: 0.89x of plain). Pooled, one
        probe round of 16 rows is evidence enough; each row's own `min_steps` would have kept the
        batch speculating for 4 more rounds after every probe.
        While the batch is learning (fewer than `min_steps` pooled lengths, or a round in which
        requests retry: `probing`) the rows switched on speculate and the others ride along only if
        padding them loses less time than a forward of their own (`_split_pays`): at 16 users a
        probe of 4 rows then costs a fraction of a speculative round of 16 (session 34)."""
        on = [s.speculating for s in states]
        if not any(on):
            return on
        if not self.enabled:
            return [True] * len(states)
        known = [length for s in states for length in s.window]
        tstar = self.threshold_at(len(states))
        if tstar is not None and len(known) >= self.min_steps:
            # rows switched off join only where the batch is expected to pay by switch_on_margin: each pays its
            # drafter's catch-up on every position it missed (SWITCH_ON_MARGIN's comment)
            if self.pooled_tau(known) >= tstar * (1 if all(on) else 1 + self.switch_on_margin):
                return [True] * len(states)
            if not probing:
                return [False] * len(states)
        return on if self._split_pays(len(states), sum(on)) else [True] * len(states)

    def _split_pays(self, rows: int, speculating: int) -> bool:
        """Whether `speculating` of `rows` rows speculating in a forward apart from the plain rows'
        loses less time than all rows padded to the tree's width, each judged against plain rounds
        making the same tokens (plain steps are the alternative for every token), on the measured
        cost curves and the global tau (1 before any is known: the riders' gain is then unproven)."""
        if speculating == rows or self.width is None:
            return False
        costs = [self.forward(rows, 1), self.verify_cost(rows, self.width), self.verify_cost(speculating, self.width),
                 self.forward(rows - speculating, 1), self.drafting_cost(rows), self.drafting_cost(speculating)]
        if any(c is None for c in costs):
            return False
        plain_all, pad_fwd, spec_fwd, plain_rest, draft_all, draft_some = costs
        tau, per_token = max(self.global_tau or 1.0, 1.0), plain_all / rows
        padded = draft_all + pad_fwd - rows * tau * per_token
        split = draft_some + spec_fwd + plain_rest - (speculating * tau + rows - speculating) * per_token
        return split < padded

    def veto(self, states: list[RequestState]) -> list[RequestState]:
        """A batched round decided plain (`round_plan`): the rows still speculating switch off
        (returned), due for a retry after `retry_after` plain tokens like any switched-off row. Left
        on, they would never be due, and the batch would probe again only when a request arrived.
        Every row's window is forgotten: it was judged, and the next probe, of a few rows, must
        decide on their fresh lengths, not be outvoted by the whole batch's old ones."""
        vetoed = [s for s in states if s.speculating]
        for state in vetoed:
            self._switch_off(state)
        for state in states:
            state.window.clear()
        return vetoed

    def _switch_off(self, state: RequestState) -> None:
        state.speculating, state.plain_left = False, self.retry_after
        state.switches += 1
        self.switches_off += 1


# --- one stream -------------------------------------------------------------------------------------

PRIOR_ACCEPTANCE = 0.5  # per-depth acceptance assumed before any draft was verified (a weak drafter's)
PRIOR_WEIGHT = 4  # ... worth this many verified drafts at each depth
MAX_CHAIN = 8  # deepest chain choose_shape considers
# Trees choose_shape prices beside the chains. Where a verify of 16 tokens costs little more than one
# of 1 (an AMX CPU: 1.16x), EAGLE's 4,4,16 tree drafts at about a chain's cost and accepts more
# (session 39, 16 MT-bench prompts: 1.71x the plain loop against 1.34x when only chains were priced;
# benchmarks/bench_default_shape.py, docs/results.md).
TREE_CANDIDATES = (TreeShape(4, 4, 16),)
# A tree's tau is priced as 1 + (its top-1 chain's expected tau - 1) * ratio, the ratio learned from
# its own steps: accepted tokens over those its top-1 chain had accepted in the same steps (each step
# says both: DraftTree.top_ranked_run). Before any, the prior: the EAGLE-3.1 release's 4,4,16 tree
# on 16 MT-bench first turns (1.55 over 1,328 steps, session 39), worth TREE_PRIOR_WEIGHT chain tokens.
# A drafter whose top-1 chain is never accepted (tau 1) prices every tree at tau 1 too.
# Per regime (REGIMES): at T=1 the tree's first level is drawn from q without replacement (session 71); round 24's
# 4,4,16 tree there accepted 1.41 tokens per token of its top-1 chain (996 steps, 27 MT-bench first turns; 1.51
# at T=0 on the same prompts; session 73, benchmarks/results/s73/regimes.py).
PRIOR_TREE_RATIO = {GREEDY: 1.55, SAMPLED: 1.41}
TREE_PRIOR_WEIGHT = 32
MIN_PRICED_CHAIN = 4  # choose_shape prices chains this deep before any is measured (the calibrated depth)
SHAPE_MARGIN = 0.05  # choose_shape keeps the current shape unless another is expected this much faster
# Every EXPLORE_EVERY speculative steps of a measured shape, one step drafts another candidate instead:
# of those expected at least EXPLORE_FLOOR of the current shape's speed, the one drafted least recently
# (StreamMonitor.explore). Without it a shape not drafted keeps the costs it was calibrated with: on a
# noisy host a stream priced the tree's 16-token verify at 77 ms (calibrated) against ~58 realised,
# left it for chains after one bad prompt, and never came back (session 40). Least recently drafted,
# not the runner-up: the runner-up is usually the chain one level off, and the shape whose cost is
# wrong is the one never drafted. A step in 16 at >= 0.8x costs at most ~1.3 % of the speed.
EXPLORE_EVERY = 16
EXPLORE_FLOOR = 0.8
# The floor trusts the estimates, and two kinds are not worth trusting: one that rests on the calibration
# alone (its few timed forwards priced the tree's verify 33 % over a real step in session 40), and one not
# refreshed for long, which may rest on a single unlucky step. So a candidate whose verify (or a tree's
# drafting) cost is still the calibration's is plausible whatever its estimate (one step each, once per
# machine where the costs are kept), and so is one not drafted in the last EXPLORE_STALE explore() calls
# of this process (at most one step in EXPLORE_STALE per candidate).
EXPLORE_STALE = 256
# A stream's costs are the median of each size's last COST_WINDOW real steps, not a moving average: a
# step here and there runs 30-50 % slow on a shared host (a 16-token verify: 55 ms median, 72 ms worst of
# 142 steps, session 43), and a candidate drafted only when explored has few samples. With a moving
# average (0.2) one slow step moved an estimate 6-10 % and the stream hopped between the tree and chains.
COST_WINDOW = 9
# The host's speed drifts: the same tree step took 57-77 ms from prompt to prompt (session 43), and a
# candidate drafted only when explored was priced at another moment's speed than the shape beside it
# (the tree over chain 4: 0.91-1.28 within one run, 1.15 measured quietly). So a stream's costs are kept
# in a unit its own shape defines: the median of the shape's first PACE_WINDOW steps as the stream's shape
# (at the pace then in force: seconds for the first shape), held fixed while it stays. Every step's time
# is divided by the pace, how much slower than that the shape's last PACE_WINDOW steps ran (median), so an
# explored step is priced against its neighbours, not against the time of day. (A pace from costs that
# the paced steps themselves update has no fixed unit: it wandered 70 % in a simulated stream. A unit
# from one step set every later cost by that step's noise.)
PACE_WINDOW = 8
CALIBRATED_SIZES = tuple(sorted({*range(2, MAX_CHAIN + 2), *(t.total_tokens for t in TREE_CANDIDATES)}))
STATE_VERSION = 3  # bump when StreamMonitor.state() changes meaning (3: acceptance per regime)

# A stream's window is judged shrunk toward its long-run tau, as if PRIOR_STEPS more steps had come in at the
# tau its shape is expected to reach (expected_shape_tau: every verified draft of the process, and of earlier
# ones where the costs are kept). A window's mean says less about the steps to come than it seems: on 60
# AlpacaEval prompts (EAGLE-3 round 14, chain 3) the mean of the next 16 accepted lengths followed the last
# 16's by 0.65 and the last 8's by 0.50, the rest regressing to the drafter's mean: weights n / (n + 8).
# Judged raw, a tau-1.9 drafter switched off on short runs of misses: 385-1,049 tokens plain over those sets,
# slower than speculating throughout; replayed offline over those prompts and MT-bench's 80 at float32's step costs, the shrunk window
# ran at 1.33x plain against 1.30x, level with never switching off (1.34x / 1.33x); a drafter made to fit half
# the prompts ran at 1.13-1.14x either way, and one that never fits at 0.99x (benchmarks/fallback_sim.py, s56;
# with 15 % step-time noise the gain shrinks to +0.4-0.9 %, the shape chosen on noisy costs then costing more).
PRIOR_STEPS = 8


# A greedy stream's step whose context lookup found a chain may verify that chain alone instead of the drafter's tree
# with the chain merged in (ChainChoice): in a repetition the copied chain accepts what the drafter would, for a verify
# of fewer rows and no drafter passes. Skipping the drafter whenever a chain of 4+ was found ran 1.09x the defaults
# on 8 EAGLE summarisation prompts and 0.99-1.01x on MT-bench, QA and HumanEval (round 24, bf16, 2 threads,
# session 78): where the chain does not win the drafter's rows must stay, so each step is priced. Priced, against
# always merging (three runs, bf16 and float32, 2 threads, benchmarks/results/s78/): summaries 1.035-1.076x (geometric
# mean per prompt, 14 of 16 prompts faster in each run); MT-bench, QA and HumanEval 0.97-1.02x, within what two
# identical engines differ by in the same run (0.977-0.997x).
GAIN_PRIOR_WEIGHT = 4  # the drafter's gain over a chain found L long, before measured, is worth this many steps


class ChainChoice:
    """What a copied chain of each found length L wins alone and what the drafter's tree adds to it, learned from a
    greedy stream's verified steps (ticks: steps; both fade over lookup.CHAIN_MEMORY of them, lookup.faded_by):
    - the chain's own acceptance (ChainAcceptance): from every step that verified a chain, merged or alone; in a
      merged step the chain alone would have accepted exactly its common prefix with what the step emitted
      (greedy verification follows the target's tokens whichever node holds them);
    - the drafter's gain: in a merged step, tokens accepted beyond the chain's own (>= 0), and the verify rows the
      chain added beside the drafter's tree. Before any step at L, the gain is the drafter's expected accepted
      tokens (the optimistic prior: as though the chain won nothing the drafter would not), and the rows L; a
      length where the chain is chosen alone keeps no merged steps, so its gain fades back to the prior and a
      merged step is tried again."""

    def __init__(self):
        self.chains = ChainAcceptance()
        self.merged: dict[int, list[float]] = {}  # found -> [tick of the last update, weight, gain sum, rows sum]

    def tick(self) -> None:
        self.chains.tick()

    def _faded(self, found: int) -> list[float]:
        entry = self.merged.setdefault(found, [self.chains.rounds, 0.0, 0.0, 0.0])
        fade = faded_by(self.chains.rounds - entry[0])
        entry[0], entry[1], entry[2], entry[3] = self.chains.rounds, entry[1] * fade, entry[2] * fade, entry[3] * fade
        return entry

    def learn(self, found: int, chain_accepted: int, merged: bool = False, accepted: int = 0, rows: int = 0) -> None:
        """A chain found `found` long, verified whole (a stream never caps it), `chain_accepted` of it accepted;
        `merged`: in the drafter's tree, the step accepting `accepted` in all, the chain adding `rows` verify rows."""
        self.chains.learn(True, found, found, chain_accepted)
        if merged:
            entry = self._faded(found)
            entry[1] += 1
            entry[2] += accepted - chain_accepted
            entry[3] += rows

    def chain_tokens(self, found: int) -> float:
        """E[tokens the chain found `found` long accepts alone]."""
        return self.chains.expected_by_offered(True, found)[found]

    def as_json(self) -> dict:
        """What was learned, faded to now: per found length, the chain's positions ([reached, accepted] weights) and
        the merged steps' [weight, gain, rows] sums."""
        return {"chains": {str(found): self.chains.positions(True, found)
                           for greedy, found in list(self.chains.counts) if greedy},
                "merged": {str(found): self._faded(found)[1:] for found in list(self.merged)}}

    @classmethod
    def from_json(cls, data: dict) -> "ChainChoice":
        choice = cls()
        for found, positions in data.get("chains", {}).items():
            choice.chains.keep(True, int(found), positions)
        for found, (weight, gain, rows) in data.get("merged", {}).items():
            if min(weight, gain, rows) < 0:
                raise ValueError(f"merged-step sums for length {found} are negative")
            choice.merged[int(found)] = [0, float(weight), float(gain), float(rows)]
        return choice

    def drafter_gain(self, found: int, prior: float) -> tuple[float, float]:
        """E[tokens the drafter's tree accepts beyond such a chain], E[rows the chain adds beside the tree]; `prior`:
        the drafter's expected accepted tokens."""
        _, weight, gain, rows = self._faded(found)
        return ((prior * GAIN_PRIOR_WEIGHT + gain) / (GAIN_PRIOR_WEIGHT + weight),
                (found * GAIN_PRIOR_WEIGHT + rows) / (GAIN_PRIOR_WEIGHT + weight))


class StreamMonitor(DriftMonitor):
    """The drift monitor for one stream at a time (see the module docstring). `verify` and `draft`
    are the per-step cost curves; `forward` / `drafting` of the round-based parent stay unused."""

    # min_steps 8, not the server's 4: a stream's switch-off waits for 8 verified drafts. On 48 MT-bench
    # first turns (3 runs of 16, bf16, session 41) round 17 ran at 1.73-1.87x the plain loop (median)
    # against 1.58-1.80x with 4: four drafts of a weak opening switched a tau-2.7 drafter off, and a
    # random drafter stayed level (1.02-1.03x against 0.99-1.02x). benchmarks/results/s41/fallback_window.py
    def __init__(self, window: int = 16, min_steps: int = 8, retry_after: int = 32, global_window: int = 128,
                 threshold: float | None = None, enabled: bool = True, smoothing: float = 0.2,
                 global_min_steps: int = 32, max_retry_after: int | None = None, cost_window: int | None = COST_WINDOW):
        """`cost_window`: costs are the median of each size's last `cost_window` steps (None: moving
        averages with `smoothing`, as the server's)."""
        super().__init__(window, min_steps, retry_after, global_window, threshold, enabled, smoothing,
                         global_min_steps, max_retry_after)
        # seconds per step of N tokens / drafting depth d
        self.verify, self.draft = CostCurve(smoothing, cost_window), CostCurve(smoothing, cost_window)
        self.cost_window = cost_window  # self.shape: the TreeShape the stream drafts with, its break-even's
        # tree shape -> its drafting time, a curve over its depth (one point; provisional: the calibration's)
        self.tree_draft: dict[str, CostCurve] = {}
        self.calibrated = False
        self.clock = 0  # explore() calls: speculative steps of measured shapes
        self.last_drafted: dict[str, int] = {}  # shape -> clock of its latest step
        # steps drafted with another candidate than the stream's shape (this process), per shape drafted instead
        self.explored_shapes: Counter[str] = Counter()
        self.explore_stale: float = EXPLORE_STALE  # inf: the floor alone decides (sessions 41-42's rule)
        self.follow_pace = True  # False: costs in seconds as measured (session 43's rule)
        self.pace_samples: deque = deque(maxlen=PACE_WINDOW)  # the shape's recent steps' time over its unit cost
        self.unit: tuple[str, float] | None = None  # the shape that sets the pace, and its cost held fixed
        self.unit_steps: list[tuple[str, float]] = []  # a new shape's first steps (paced), measuring its unit
        # a stream's probe is a few drafted steps, not a batch's catch-up; waits growing to 4,096 steps would keep a
        # drafter off for dozens of prompts after the traffic changed: forced probes stay every max_retry_after
        self.probe_doublings = 0
        self.shape_margin = SHAPE_MARGIN  # choose_shape's hysteresis (an attribute so that a replay can vary it)
        self.chain_choice: ChainChoice | None = ChainChoice()  # None: every chain found is merged (before session 78)
        # a chain goes alone only where priced this much faster than merged: at 0.1 the summaries' gain halved and
        # nothing changed elsewhere (session 78), so 0
        self.chain_margin = 0.0

    def gate_window(self, regime: str | None = None) -> deque:
        """A stream is gated, and its probes judged, on its selected regime's recent steps (None)."""
        return super().gate_window(self.regime if regime is None else regime)

    # --- costs ----------------------------------------------------------------------------------
    def observe_step(self, kind: str, tokens: int, depth: int, accepted: int, step_s: float, draft_s: float,
                     catch_up: bool = False, top_ranked: int | None = None, top_depth: int | None = None,
                     shape: TreeShape | None = None, lookup_accepted: int = 0) -> None:
        """One step of the stream (`kind` "plain", "lookup": a copied chain alone, or "speculative"): `tokens`
        verified in a step of `step_s` seconds (drafting included), `draft_s` of them drafting a depth-`depth`
        draft. `catch_up`: the drafter first read the features of a plain stretch, so its time says nothing
        about a draft's cost. `top_ranked`, `top_depth`: of a tree's accepted nodes, how many lay on its top-1
        chain, and that chain's depth (StepReport; None: the draft is a chain, `accepted` and `depth` say it).
        `shape`: the shape the step drafted with (None: the stream's; explore() picks others).
        `depth` and `accepted` are the drafter's own tree's; `lookup_accepted`, the tokens a context-lookup chain
        won past its path (decode/lookup.py), teach nothing about the drafter (its verify rows are in `tokens`, its
        gain in the stream's realised tau, StreamMonitor.record); a tracer of the steps reads it
        (benchmarks/bench_default_shape.py)."""
        if kind not in ("plain", "lookup", "speculative"):
            return
        shape = shape if shape is not None else self.shape
        tree = shape is not None and not shape.is_chain and kind == "speculative"
        # what the drafting time teaches: a tree's own cost, only from a draft of its full depth; a chain's
        # the curve over depths; nothing after a plain stretch (the drafter first read its features)
        if catch_up:
            draft_curve = None
        elif tree:
            draft_curve = self.tree_draft_curve(shape) if depth == shape.depth else None
        else:
            draft_curve = self.draft
        pace = self.pace()
        full_step = (kind == "speculative" and not catch_up and shape is not None and shape == self.shape
                     and depth == shape.depth and tokens == shape.total_tokens)
        if self.follow_pace and full_step:  # only the stream's own shape, whole, sets the pace
            self._keep_pace(shape, step_s, pace)
        step_s, draft_s = step_s / pace, draft_s / pace
        if kind == "plain":
            self.verify.add(1, step_s)
            return
        self.verify.add(tokens, step_s - draft_s)  # draft_s: of a copied chain alone, the lookup's own time
        if kind == "lookup":
            return
        if draft_curve is not None:
            draft_curve.add(depth, draft_s)
        self.learn_acceptance(shape if tree else None, depth, accepted, top_ranked, top_depth)

    def pace(self) -> float:
        """How much slower than its unit cost the stream's shape ran its last PACE_WINDOW steps (PACE_WINDOW's
        comment; 1 before any, or with follow_pace off): what a new step's time is divided by."""
        return statistics.median(self.pace_samples) if self.follow_pace and self.pace_samples else 1.0

    def _keep_pace(self, shape: TreeShape, step_s: float, pace: float) -> None:
        key = shape_key(shape)
        if self.unit is None or self.unit[0] != key:  # a new shape: its first steps, at the pace in force, are its unit
            if self.unit_steps and self.unit_steps[0][0] != key:
                self.unit_steps = []
            self.unit_steps.append((key, step_s / pace))
            if len(self.unit_steps) < PACE_WINDOW:
                return
            self.unit, self.unit_steps = (key, statistics.median(t for _, t in self.unit_steps)), []
        self.pace_samples.append(step_s / self.unit[1])

    def tree_draft_curve(self, shape: TreeShape) -> CostCurve:
        """The drafting time of tree `shape`, learned like the chains' (one point, at its depth)."""
        key = shape_key(shape)
        if key not in self.tree_draft:
            self.tree_draft[key] = CostCurve(self.smoothing, self.cost_window)
        return self.tree_draft[key]

    def draft_cost(self, shape) -> float | None:
        curve = self.draft if shape.is_chain else self.tree_draft.get(shape_key(shape))
        return None if curve is None else curve(shape.depth)

    def relative_step_cost(self, shape, floor: bool = True) -> float | None:
        """A speculative step with `shape` (drafting, then a verify priced at no less than a plain step,
        `at_least`) over a plain step: the break-even tau; None while a cost is unknown. `floor=False`:
        the verify as measured, for ranking shapes against each other (`_rank`)."""
        plain, verify, draft = self.verify(1), self.verify(shape.total_tokens), self.draft_cost(shape)
        if not plain or verify is None or draft is None:
            return None
        return (draft + (at_least(verify, plain) if floor else verify)) / plain

    def speedup(self, shape, floor: bool = True) -> float | None:
        """Expected tokens/s of speculating with `shape` over plain decoding (None: costs unknown)."""
        cost = self.relative_step_cost(shape, floor)
        return None if cost is None else self.expected_shape_tau(shape) / cost

    def chain_alone(self, found: int) -> bool:
        """Whether a greedy step whose context lookup found a chain `found` long verifies the chain alone, rather
        than the stream's shape with the chain merged in (ChainChoice): alone when

            (1 + E[chain]) / verify(found + 1)  >  (1 + E[chain] + E[gain]) / (draft + verify(tree + rows))

        E[chain]: the tokens the chain accepts alone; E[gain], rows: what the drafter's tree adds beside it and the
        rows the chain adds to the tree; on the stream's costs. False while a cost is unknown, for sampled decoding
        (a chain alone wins little there: lookup.py), and with the monitor disabled (speculation forced)."""
        choice = self.chain_choice
        if choice is None or not self.enabled or self.regime != GREEDY or self.shape is None or found < 1:
            return False
        gain, rows = choice.drafter_gain(found, self.expected_shape_tau(self.shape) - 1)
        alone, draft = self.verify(found + 1), self.draft_cost(self.shape)
        merged = self.verify(self.shape.total_tokens + rows)
        if not alone or draft is None or merged is None:
            return False
        chain = choice.chain_tokens(found)
        return (1 + chain) / alone > (1 + self.chain_margin) * (1 + chain + gain) / (draft + merged)

    def learn_chain(self, kind: str, found: int, chain_accepted: int, accepted: int, rows: int) -> None:
        """One step of a greedy stream (a tick of ChainChoice's memory); with a chain found `found` long (0: none),
        `chain_accepted` of it accepted, alone (`kind` "lookup") or merged into the drafter's tree ("speculative":
        the step accepted `accepted`, the chain added `rows` rows)."""
        if self.chain_choice is None or self.regime != GREEDY:
            return
        self.chain_choice.tick()
        if found and kind in ("lookup", "speculative"):
            self.chain_choice.learn(found, chain_accepted, kind == "speculative", accepted, rows)

    def choose_shape(self, max_depth: int = MAX_CHAIN, trees=TREE_CANDIDATES, current: TreeShape | None = None):
        """The shape with the best expected speedup, and that speedup (below 1: speculation is not
        expected to pay): every chain up to `max_depth`, and `trees` whose drafting cost is known.
        Chains reach one level past the deepest depth measured (`measured_depth`), at least
        MIN_PRICED_CHAIN: deeper ones would be priced on the deepest rate alone, extrapolated, and a
        stream that had drafted depth 4 at most chose a chain of 7 that ran at 0.72x of the tree it
        left (session 39). Each level chosen measures the next.
        `current` (the shape drafted so far) stays unless another is expected SHAPE_MARGIN faster:
        the candidates' estimates sit within a few per cent of each other and move with every
        prompt, and without the margin a stream hopped between deep chains and the tree, its
        deep-chain estimates the least certain (session 39)."""
        best = max(self.candidates(max_depth, trees), key=self._rank)
        kept = self._rank(current) if current is not None else 0.0
        if kept and kept * (1 + self.shape_margin) >= self._rank(best):
            best = current
        return best, self.speedup(best)

    def _rank(self, shape) -> float:
        """What shapes are ranked on: the expected speedup with each verify as measured (0: unpriced). The
        `at_least` floor is for weighing speculation against plain decoding only (the break-even, a stream
        starting plain): where a 4-token verify ran faster than a plain step (the compiled step on the AMD
        host, 13.1 against 14.2 ms, session 47) it priced every chain ~6 % high and the tree, whose verify
        costs more than a plain step, not at all, a bias toward the tree wherever that happens."""
        return self.speedup(shape, floor=False) or 0.0

    def candidates(self, max_depth: int = MAX_CHAIN, trees=TREE_CANDIDATES) -> list[TreeShape]:
        """The shapes choose_shape prices: chains one level past the deepest measured depth (at least
        MIN_PRICED_CHAIN, at most `max_depth`), and `trees`."""
        deepest = max(self.measured_depth() + 1, MIN_PRICED_CHAIN)
        return [TreeShape.chain(d) for d in range(1, min(max_depth, deepest) + 1)] + list(trees)

    def explore(self, current: TreeShape, trees=TREE_CANDIDATES) -> TreeShape | None:
        """Called before each speculative step drafted with the measured shape `current`: every
        EXPLORE_EVERY-th call, another of choose_shape's candidates (with `trees`) to draft this one
        step with instead, so that its costs and acceptance come from real steps of this run and not
        only from the calibration: of those expected at least EXPLORE_FLOOR of `current`'s speed, still
        priced on the calibration, or not drafted for EXPLORE_STALE calls, the one drafted least recently
        (the fastest of those never drafted). None otherwise. Any shape is lossless: only speed is at stake."""
        self.clock += 1
        pick = self._least_recent_plausible(current, trees) if self.clock % EXPLORE_EVERY == 0 else None
        self.last_drafted[shape_key(pick or current)] = self.clock
        if pick is not None:
            self.explored_shapes[shape_key(pick)] += 1
        return pick

    @property
    def explored(self) -> int:
        """Steps drafted with another candidate than the stream's shape (this process)."""
        return sum(self.explored_shapes.values())

    def priced_on_calibration(self, shape: TreeShape) -> bool:
        """Whether `shape`'s verify cost (a tree's: or its drafting cost) is still the calibration's guess."""
        drafting = None if shape.is_chain else self.tree_draft.get(shape_key(shape))
        return cost_bucket(shape.total_tokens) in self.verify.provisional or bool(drafting and drafting.provisional)

    def estimates(self, trees=TREE_CANDIDATES) -> dict[str, dict[str, float | None]]:
        """What choose_shape and explore decide on, for a benchmark to show: by shape key, each
        candidate's expected tokens per step (`tau`), step cost over a plain step (`cost`, the verify
        floored at a plain step; None: a cost unknown), their ratio (`speedup`: whether speculating pays)
        and the same ratio with the verify as measured (`rank`: what shapes are ranked on, 0: unpriced)."""
        return {shape_key(s): {"tau": self.expected_shape_tau(s), "cost": self.relative_step_cost(s),
                               "speedup": self.speedup(s), "rank": self._rank(s)} for s in self.candidates(trees=trees)}

    def _least_recent_plausible(self, current: TreeShape, trees) -> TreeShape | None:
        kept = self._rank(current)
        if not kept:
            return None

        def plausible(s: TreeShape) -> bool:
            return (self._rank(s) >= EXPLORE_FLOOR * kept or self.priced_on_calibration(s)
                    or self.clock - self.last_drafted.get(shape_key(s), 0) >= self.explore_stale)

        picks = [s for s in self.candidates(trees=trees) if s != current and plausible(s)]
        return min(picks, key=lambda s: (self.last_drafted.get(shape_key(s), -1), -self._rank(s)),
                   default=None)

    # --- memory across processes ----------------------------------------------------------------
    def state(self) -> dict:
        """What this stream has learned (costs, per-depth acceptance, copied chains), as JSON-able data."""
        return {"version": STATE_VERSION, "verify": sorted(self.verify.points.values()),
                "draft": sorted(self.draft.points.values()),
                "acceptance": {regime: learned.as_json() for regime, learned in self.learned.items()},
                "tree_draft": {k: self.draft_cost(TreeShape.parse(k)) for k, c in self.tree_draft.items() if c.points},
                # greedy streams' copied chains and the drafter's gain beside them (absent before session 78)
                "chain_choice": self.chain_choice.as_json() if self.chain_choice is not None else None,
                # which costs are still the calibration's (the first real step replaces them)
                "provisional": {"verify": sorted(self.verify.provisional), "draft": sorted(self.draft.provisional),
                                "trees": sorted(k for k, c in self.tree_draft.items() if c.provisional)}}

    def restore(self, state: dict) -> bool:
        """Take up what an earlier process learned (`state()`): its costs stand in for the
        calibration when they cover a plain step, a verify and a draft. False (nothing taken)
        if the state is not one this version (or version 2, sessions 41-72) wrote. Version 2 kept one
        acceptance set for all regimes: it is taken as greedy's (the default temperature), and sampled
        decoding starts from its prior."""
        try:
            version = state.get("version")
            if version not in (2, STATE_VERSION):
                return False
            verify = [(float(x), float(y)) for x, y in state["verify"]]
            draft = [(float(x), float(y)) for x, y in state["draft"]]
            by_regime = state["acceptance"] if version == STATE_VERSION else {GREEDY: state}
            learned = {regime: Acceptance.from_json(by_regime[regime]) if by_regime.get(regime) else Acceptance()
                       for regime in REGIMES}  # a regime never decoded: nothing learned
            tree_draft = {TreeShape.parse(k): float(v) for k, v in state["tree_draft"].items()}
            provisional = state.get("provisional", {})  # absent from the states of session 40 and before
            guesses = {name: {int(b) for b in provisional.get(name, ())} for name in ("verify", "draft")}
            guessed_trees = {shape_key(TreeShape.parse(k)) for k in provisional.get("trees", ())}
            chain_choice = ChainChoice.from_json(state["chain_choice"]) if state.get("chain_choice") else None
        except (AttributeError, KeyError, TypeError, ValueError, AnchorspecError):
            return False
        if any(x < 1 or y <= 0 for x, y in verify + draft) or any(y <= 0 for y in tree_draft.values()):
            return False
        self.verify.restore(verify, guesses["verify"])
        self.draft.restore(draft, guesses["draft"])
        self.learned = learned
        if chain_choice is not None and self.chain_choice is not None:
            self.chain_choice = chain_choice
        self.tree_draft = {}
        for shape, seconds in tree_draft.items():
            guessed = {cost_bucket(shape.depth)} if shape_key(shape) in guessed_trees else set()
            self.tree_draft_curve(shape).restore([(float(shape.depth), seconds)], guessed)
        self.pace_samples.clear()  # this process's steps say how fast the host is now
        self.unit, self.unit_steps = None, []
        self.calibrated = self.calibrated or (
            cost_bucket(1) in self.verify.points and len(self.verify.points) > 1 and bool(self.draft.points))
        return True

    def threshold_at(self, rows: int = 1) -> float | None:
        """tau* = (draft + verify) / plain for the stream's shape (batch 1: `rows` is ignored)."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        return None if self.shape is None else self.relative_step_cost(self.shape)

    def start(self, shape, sampling: SamplingParams | None = None) -> RequestState:
        """A new generation drafting with `shape`, decoding like `sampling` (None: the regime selected
        last): its per-request state (plain from the start while the recent steps of earlier
        generations of its regime say speculation does not pay)."""
        if sampling is not None:
            self.select(sampling)
        self.shape = shape
        state = self.new_request(regime=self.regime)
        expected = self.speedup(shape) if not self.gate_window() else None
        if state.speculating and self.enabled and expected is not None and expected < 1:
            self._switch_off(state)  # no step measured yet, and the costs say even a good draft would not pay
        return state

    # --- calibration ----------------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, target, proposer, context: int = 128, sizes=CALIBRATED_SIZES, depths=(1, 4),
                  repeats: int = 3, trees=TREE_CANDIDATES) -> None:
        """Seed the curves with a few timed forwards on a dummy context: the target over 1 and
        `sizes` tokens (every chain and tree choose_shape prices), and the drafter drafting chains of
        `depths` and the `trees` (each the median of `repeats`, after one warm-up). Costs learned
        from real steps replace these as they come."""
        verify, plain = verify_cost(target, context, list(sizes), repeats=repeats)
        self.verify.add(1, plain, provisional=True)
        for n, seconds in verify.items():
            self.verify.add(n, seconds, provisional=True)
        shapes = [TreeShape.chain(d) for d in depths] + list(trees)
        updates = (repeats + 1) * len(shapes)  # one new position per timed draft, as in decoding
        ids = torch.arange(context + updates + 1) % target.vocab_size
        aux = target.forward(ids[:-1], torch.arange(ids.numel() - 1), target.new_cache(), capture_aux=True).aux
        proposer.reset()
        proposer.update(ids[:context], aux[:context - 1])
        fed = context - 1  # positions whose features the proposer has read
        for shape in shapes:
            samples = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                proposer.update(ids[:fed + 2], aux[fed:fed + 1])
                proposer.propose(shape, SamplingParams(), None)
                samples.append(time.perf_counter() - t0)
                fed += 1
            seconds = statistics.median(samples[1:])  # the first is a warm-up
            if shape.is_chain:
                self.draft.add(shape.depth, seconds, provisional=True)
            else:
                self.tree_draft_curve(shape).add(shape.depth, seconds, provisional=True)
        proposer.reset()
        self.calibrated = True
