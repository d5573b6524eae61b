"""Prometheus metrics of the server, on a registry of its own (not the process-global one), so
several apps (tests) never collide and /metrics shows only these series."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decode.engine import StepReport

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0)


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
        self.lookup_drafted_tokens = Counter("anchorspec_lookup_drafted_tokens",
                                             "Draft tokens a context-lookup chain added beside the drafter's "
                                             "(with no drafter: every draft token, prompt lookup)", registry=r)
        self.lookup_accepted_tokens = Counter("anchorspec_lookup_accepted_tokens",
                                              "Accepted tokens past the drafter's own path (what the lookup chains won)",
                                              registry=r)
        self.accepted_per_position = Counter(
            "anchorspec_accepted_tokens_per_position", "Accepted draft tokens by depth (1 = first draft token)",
            ["position"], registry=r)
        self.fallback_switches = Counter("anchorspec_fallback_switches",
                                         "Drift fallback switches: off = to plain decoding, on = speculation retried",
                                         ["direction"], registry=r)
        self.shape_changes = Counter("anchorspec_draft_shape_changes",
                                     "Changes of the rounds' draft shape (chosen by the batch's row count), by the new "
                                     "shape (TOP_K,DEPTH,TOTAL)", ["shape"], registry=r)
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
        self.round_break_even_tau = Histogram(
            "anchorspec_round_break_even_tau", "Break-even tau*(B) at each batched round's batch size B (the gauge "
            "above is the latest only: after a burst it reads the small B at its tail)", buckets=TAU_BUCKETS,
            registry=r)
        self.rolling_tau = Gauge("anchorspec_rolling_tau", "Global rolling tau over recent speculative steps",
                                 registry=r)
        self.target_forwards = Counter("anchorspec_target_forwards",
                                       "Target forwards: prefill (one sequence alone), batched (decode/verify), solo "
                                       "(a decode/verify step alone: a cache that cannot join the batch)",
                                       ["kind"], registry=r)
        self.batch_rows = Histogram("anchorspec_batch_rows", "Sequences per batched target forward",
                                    buckets=ROW_BUCKETS, registry=r)
        self.batch_tokens = Histogram("anchorspec_batch_tokens",
                                      "Real new tokens per batched target forward (padding excluded)",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.batch_padded_tokens = Counter("anchorspec_batch_padded_tokens",
                                           "Token slots computed by batched forwards, padding included (rows x width)",
                                           registry=r)
        self.batch_forward_seconds = Histogram("anchorspec_batch_forward_seconds", "Wall time of one batched forward",
                                               buckets=LATENCY_BUCKETS, registry=r)
        self.draft_levels = Counter("anchorspec_draft_levels",
                                    "Lockstep drafting levels (each: one drafter forward over all drafting sequences, "
                                    "wide passes aside)", registry=r)
        self.draft_rows = Histogram("anchorspec_draft_rows", "Sequences drafting together in a round",
                                    buckets=ROW_BUCKETS, registry=r)
        self.draft_seconds = Histogram("anchorspec_draft_seconds", "Wall time of a round's drafting",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.compiled_rounds = Counter("anchorspec_compiled_rounds",
                                       "Rounds during which torch.compile built a graph (--compile; seconds each, "
                                       "left out of the measured round costs)", registry=r)
        for outcome in ("ok", "cancelled", "error"):  # export zeros, so rates work from the first scrape
            self.requests.labels(outcome)
        for direction in ("off", "on"):
            self.fallback_switches.labels(direction)
        for kind in ("prefill", "batched", "solo"):
            self.target_forwards.labels(kind)

    def observe_step(self, report: StepReport) -> None:
        self.generated_tokens.inc(len(report.tokens))
        if report.kind in ("speculative", "lookup"):  # a lookup step: a copied chain alone (prompt lookup)
            self.lookup_drafted_tokens.inc(report.lookup_rows)
            self.lookup_accepted_tokens.inc(report.accepted - report.drafter_accepted)
        if report.kind == "speculative":
            self.drafts.inc()
            self.drafted_tokens.inc(report.drafted)
            self.accepted_tokens.inc(report.accepted)
            for position in range(1, report.accepted + 1):
                self.accepted_per_position.labels(str(position)).inc()

    def observe_round(self, result) -> None:
        """One scheduler round (decode/round.RoundResult): its prefills, its drafting and its batched forward."""
        if result.compiled:
            self.compiled_rounds.inc()
        self.target_forwards.labels("prefill").inc(result.prefills)
        self.target_forwards.labels("solo").inc(result.solo)
        if result.rows:
            self.target_forwards.labels("batched").inc()
            self.batch_rows.observe(result.rows)
            self.batch_tokens.observe(result.tokens)
            self.batch_padded_tokens.inc(result.rows * result.width)
            self.batch_forward_seconds.observe(result.forward_s)
        if result.draft_passes:
            self.draft_levels.inc(result.draft_passes)
            self.draft_rows.observe(result.draft_rows)
            self.draft_seconds.observe(result.draft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
