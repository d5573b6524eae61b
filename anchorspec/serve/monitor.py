"""Drift fallback: stop speculating for a request whose drafter no longer pays, retry later.

Break-even, from the server's own measured round costs. All running sequences share each round:
one drafting pass per draft level over the B drafting sequences, then one target forward over all B
rows padded to the widest (a tree of W nodes; a plain row is 1 token). So with B sequences

    speculating costs  c_spec  = drafting(B) + forward(B * W)  per round and yields tau tokens per sequence,
    plain costs        c_plain = forward(B)                    per round and yields 1 token per sequence,

and speculation is faster while tau > tau*(B) = c_spec / c_plain. At B = 1 this is the batch-1
break-even (t_draft + t_verify) / t_plain. Under load it rises where a forward's cost grows with
the tokens it computes (a CPU; a GPU at large B): the B * (W - 1) extra tokens are no longer
nearly free, and plain rows padded next to a tree pay for them too.

forward(tokens) and drafting(rows) are cost curves (CostCurve: moving averages per power-of-two
bucket of the work, interpolated) learned from every round the scheduler reports (`observe_round`:
padded tokens and wall time of the batched forward, drafting rows and wall time), seeded by a
short calibration at start-up at batch 1 and 4. B is the row count of the latest round; W the width of the latest drafting round.
A fixed `threshold` overrides tau*.

Per request: the rolling mean of the last `window` accepted lengths (accepted + 1, EAGLE's tau).
Once at least `min_steps` are in the window and it falls below tau*, the request switches to
plain decoding; after `retry_after` plain tokens it is due to speculate again with an empty
window, which it does at the next retry round (every `retry_after` rounds, all due requests
together: see `start_round`).
Globally: the same rolling tau over the last `global_window` steps of all requests; while it is
below tau*, new requests start in plain mode (and retry like the others), so a drafter that stops
fitting the traffic stops costing every new request its first `min_steps` steps.

Lossless either way (plain steps are verified target tokens). Seeded sampling stays
reproducible only while no switch happens: a switch changes how the random stream is consumed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RequestState:
    window: deque = field(default_factory=deque)  # accepted lengths (accepted + 1) of recent steps
    speculating: bool = True
    plain_left: int = 0  # plain tokens still to go before speculation is retried
    switches: int = 0

    @property
    def rolling_tau(self) -> float | None:
        return sum(self.window) / len(self.window) if self.window else None


class CostCurve:
    """Cost y of work x (padded tokens, drafting rows), learned per power-of-two bucket of x: each
    bucket keeps exponential moving averages of its x and y, and a prediction interpolates
    linearly between the neighbouring buckets' points (beyond the ends: the end segment's slope,
    or flat with one bucket). Buckets are remembered separately, so hours at batch 16 do not
    make the server forget what a batch-1 step costs. Cost never falls as work grows."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self.points: dict[int, list[float]] = {}  # bucket -> [mean x, mean y]

    def add(self, x: float, y: float) -> None:
        point = self.points.get(int(x).bit_length())
        if point is None:
            self.points[int(x).bit_length()] = [float(x), float(y)]
        else:
            point[0] += self.smoothing * (x - point[0])
            point[1] += self.smoothing * (y - point[1])

    def __call__(self, x: float) -> float | None:
        if not self.points:
            return None
        pts = [self.points[b] for b in sorted(self.points)]
        if len(pts) == 1:
            return pts[0][1]
        i = next((k for k in range(1, len(pts) - 1) if x < pts[k][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 != x0 else 0.0
        return max(y0 + slope * (x - x0), 0.0)


class DriftMonitor:
    def __init__(self, window: int = 16, min_steps: int = 4, retry_after: int = 32, global_window: int = 128,
                 threshold: float | None = None, enabled: bool = True, smoothing: float = 0.1):
        if not (window >= 1 and 1 <= min_steps <= window and retry_after >= 1 and global_window >= 1):
            raise ValueError("need window >= min_steps >= 1, retry_after >= 1, global_window >= 1")
        self.window, self.min_steps, self.retry_after = window, min_steps, retry_after
        self.fixed_threshold, self.enabled = threshold, enabled
        self.forward, self.drafting = CostCurve(smoothing), CostCurve(smoothing)
        self.rows = 1  # sequences in the latest round: the B of tau*(B)
        self.width: int | None = None  # padded width of the latest round that drafted: the W of tau*(B)
        self.recent: deque = deque(maxlen=global_window)
        self.switches_off = self.switches_on = 0
        self.rounds = 0

    # --- costs ----------------------------------------------------------------------------------
    def observe_round(self, rows: int, width: int, forward_s: float, draft_rows: int = 0,
                      draft_s: float = 0.0) -> None:
        """One round: `rows` sequences padded to `width` tokens in a forward of `forward_s`, and
        `draft_rows` of them drafting for `draft_s` (0 rows: no drafting)."""
        if rows:
            self.rows = rows
            self.forward.add(rows * width, forward_s)
        if draft_rows:
            self.drafting.add(draft_rows, draft_s)
            self.width = width

    def threshold_at(self, rows: int) -> float | None:
        """tau*(rows) (see the module docstring); None until both round kinds have been measured."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        if self.width is None:
            return None
        plain = self.forward(rows)
        if not plain:
            return None
        return (self.drafting(rows) + self.forward(rows * self.width)) / plain

    @property
    def threshold(self) -> float | None:
        """tau* at the current batch size."""
        return self.threshold_at(self.rows)

    @property
    def global_tau(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def _pays(self, tau: float | None, n: int) -> bool:
        tstar = self.threshold
        return not self.enabled or tstar is None or n < self.min_steps or tau >= tstar

    @property
    def global_speculating(self) -> bool:
        """Whether a new request starts speculating now."""
        return self._pays(self.global_tau, len(self.recent))

    # --- per request ----------------------------------------------------------------------------
    def new_request(self) -> RequestState:
        state = RequestState(window=deque(maxlen=self.window))
        if not self.global_speculating:
            self._switch_off(state)
        return state

    def record(self, state: RequestState, kind: str, accepted: int = 0, tokens: int = 1) -> str | None:
        """Feed one step (kind "prefill", "speculative" or "plain"); returns "off" on a switch off
        (switches back on happen in start_round)."""
        if kind == "speculative":
            state.window.append(accepted + 1)
            self.recent.append(accepted + 1)
            if state.speculating and not self._pays(state.rolling_tau, len(state.window)):
                self._switch_off(state)
                return "off"
        elif kind == "plain" and not state.speculating:
            state.plain_left -= tokens  # at 0 or below it is due for a retry (start_round)
        return None

    def start_round(self, states: list[RequestState]) -> list[RequestState]:
        """Call once per scheduler round with the running requests' states; returns those that
        speculate again from this round on. Retries happen together, every `retry_after` rounds:
        in a batch, one speculating row pads every row to its tree's width, so staggered retries
        would make most rounds pay that width for a few probing requests."""
        self.rounds += 1
        if self.rounds % self.retry_after:
            return []
        due = [s for s in states if not s.speculating and s.plain_left <= 0]
        for state in due:
            state.speculating, state.window = True, deque(maxlen=self.window)
            state.switches += 1
            self.switches_on += 1
        return due

    def _switch_off(self, state: RequestState) -> None:
        state.speculating, state.plain_left = False, self.retry_after
        state.switches += 1
        self.switches_off += 1
