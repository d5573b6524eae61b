"""Drift fallback: stop speculating for a request whose drafter no longer pays, retry later.

Break-even, from the server's own measured step costs:

    a speculative step costs  c_spec  = t_draft + t_verify   and yields tau tokens on average,
    a plain step costs        c_plain = t_plain              and yields 1 token,

so speculation is faster while tau / c_spec > 1 / c_plain, i.e. while

    tau > tau* = 1 + (t_draft + t_verify - t_plain) / t_plain      ( = c_spec / c_plain ).

t_draft, t_verify and t_plain are exponential moving averages of the step timings the scheduler
reports (seeded by a short calibration at start-up; plain steps are those run in fallback mode),
so tau* follows the machine, the tree shape and the load. With batched rounds, t_verify and t_plain
are the whole batched forward the step rode in and t_draft the request's own drafting
(decode/round.py), so both step kinds are costed under the load they ran in. A fixed `threshold`
overrides it.

Per request: the rolling mean of the last `window` accepted lengths (accepted + 1, EAGLE's tau).
Once at least `min_steps` are in the window and it falls below tau*, the request switches to
plain decoding; after `retry_after` plain tokens it speculates again with an empty window.
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


class _Ema:
    def __init__(self, smoothing: float):
        self.smoothing, self.value = smoothing, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.smoothing) * self.value + self.smoothing * x


class DriftMonitor:
    def __init__(self, window: int = 16, min_steps: int = 4, retry_after: int = 32, global_window: int = 128,
                 threshold: float | None = None, enabled: bool = True, smoothing: float = 0.1):
        if not (window >= 1 and 1 <= min_steps <= window and retry_after >= 1 and global_window >= 1):
            raise ValueError("need window >= min_steps >= 1, retry_after >= 1, global_window >= 1")
        self.window, self.min_steps, self.retry_after = window, min_steps, retry_after
        self.fixed_threshold, self.enabled = threshold, enabled
        self.t_draft, self.t_verify, self.t_plain = _Ema(smoothing), _Ema(smoothing), _Ema(smoothing)
        self.recent: deque = deque(maxlen=global_window)
        self.switches_off = self.switches_on = 0

    # --- costs ----------------------------------------------------------------------------------
    def observe_plain(self, seconds: float) -> None:
        self.t_plain.add(seconds)

    def observe_speculative(self, draft_s: float, verify_s: float) -> None:
        self.t_draft.add(draft_s)
        self.t_verify.add(verify_s)

    @property
    def threshold(self) -> float | None:
        """tau* (see the module docstring); None until both costs have been measured."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        d, v, p = self.t_draft.value, self.t_verify.value, self.t_plain.value
        if d is None or v is None or not p:
            return None
        return 1 + (d + v - p) / p

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

    def record(self, state: RequestState, kind: str, accepted: int = 0, tokens: int = 1,
               draft_s: float = 0.0, verify_s: float = 0.0) -> str | None:
        """Feed one step (kind "prefill", "speculative" or "plain"); returns "off"/"on" on a switch."""
        if kind == "speculative":
            self.observe_speculative(draft_s, verify_s)
            state.window.append(accepted + 1)
            self.recent.append(accepted + 1)
            if state.speculating and not self._pays(state.rolling_tau, len(state.window)):
                self._switch_off(state)
                return "off"
        elif kind == "plain":
            self.observe_plain(draft_s + verify_s)
            if not state.speculating:
                state.plain_left -= tokens
                if state.plain_left <= 0:
                    state.speculating, state.window = True, deque(maxlen=self.window)
                    state.switches += 1
                    self.switches_on += 1
                    return "on"
        return None

    def _switch_off(self, state: RequestState) -> None:
        state.speculating, state.plain_left = False, self.retry_after
        state.switches += 1
        self.switches_off += 1
