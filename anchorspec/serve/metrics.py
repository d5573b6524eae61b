"""Prometheus metrics of the server, on a registry of its own (not the process-global one), so
several apps (tests) never collide and /metrics shows only these series."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decode.engine import StepReport

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("anchorspec_requests", "Finished requests by outcome (ok, cancelled, error)",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("anchorspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("anchorspec_generated_tokens", "Tokens emitted to clients", registry=r)
        self.drafts = Counter("anchorspec_drafts", "Verified drafts (speculative steps)", registry=r)
        self.drafted_tokens = Counter("anchorspec_drafted_tokens", "Draft tokens proposed (tree nodes)", registry=r)
        self.accepted_tokens = Counter("anchorspec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_position = Counter(
            "anchorspec_accepted_tokens_per_position", "Accepted draft tokens by depth (1 = first draft token)",
            ["position"], registry=r)
        self.fallback_switches = Counter("anchorspec_fallback_switches",
                                         "Drift fallback switches: off = to plain decoding, on = speculation retried",
                                         ["direction"], registry=r)
        self.latency = Histogram("anchorspec_request_latency_seconds", "Submit to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("anchorspec_time_to_first_token_seconds", "Submit to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("anchorspec_requests_running", "Sequences being decoded", registry=r)
        self.waiting = Gauge("anchorspec_requests_waiting", "Requests queued for a decoding slot", registry=r)
        self.speculation_enabled = Gauge("anchorspec_speculation_enabled",
                                         "1 while new requests start speculating (drafter loaded, rolling tau above "
                                         "break-even)", registry=r)
        self.speculating = Gauge("anchorspec_requests_speculating", "Running sequences in speculative mode", registry=r)
        self.break_even_tau = Gauge("anchorspec_break_even_tau", "Measured break-even tau (NaN until known)",
                                    registry=r)
        self.rolling_tau = Gauge("anchorspec_rolling_tau", "Global rolling tau over recent speculative steps",
                                 registry=r)
        for outcome in ("ok", "cancelled", "error"):  # export zeros, so rates work from the first scrape
            self.requests.labels(outcome)
        for direction in ("off", "on"):
            self.fallback_switches.labels(direction)

    def observe_step(self, report: StepReport) -> None:
        self.generated_tokens.inc(len(report.tokens))
        if report.kind == "speculative":
            self.drafts.inc()
            self.drafted_tokens.inc(report.drafted)
            self.accepted_tokens.inc(report.accepted)
            for position in range(1, report.accepted + 1):
                self.accepted_per_position.labels(str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
