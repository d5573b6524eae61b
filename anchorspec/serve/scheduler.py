"""The scheduler: one worker thread advances all active sequences together, one step per round.

Each round: admit waiting requests (up to max_running), drop cancelled ones, then one
BatchDecoder round (decode/round.py): a new sequence prefills alone and joins the batch; the other
sequences draft together, one drafter forward per draft level over all of them (each on its own
slot of the drafter's batch cache), or, in plain mode (no drafter, or the drift monitor switched it
off), offer their pending token; then ONE target forward verifies all of them (draft trees and
1-token plain rows, padded, each row with its own positions and tree mask over its own KV slot),
and each sequence commits and emits its tokens. Per-sequence state (target and drafter KV slots,
its own proposer, its own random generator) lives in a SpeculativeDecoding / PlainDecoding object
between rounds.

Results are what each request gets alone: greedy outputs token for token, seeded sampling the same
draws (float rounding of the batched forward aside); the tests check both against solo runs.
A failing sequence gets an error event and is dropped; the others go on.

Drift monitor: each round's costs (padded tokens and time of the batched forward, drafting rows
and time) feed its cost lines, so the break-even tau it compares each request's rolling tau with
is the one of the current batch size (decode/fallback.py). A round is all-speculative or all-plain,
decided by the batch (DriftMonitor.round_plan), except while the batch learns whether speculation
pays (a probe, new requests): then the rows switched on may speculate in a target forward apart from
the plain rows', where that costs less than padding them all. A row's first speculative round after
plain ones has its drafter catch up on the missed positions, a one-off kept out of the drafting cost.
With `shapes` (`anchorspec serve` given no --chain/--tree) each round drafts the shape expected fastest at its row
count (DriftMonitor.shape_for_rows: a chain of 1-4 or the default tree), and only a lone request's round merges
lookup chains, which would widen every row of a batched one.

Threads: the event loop submits and reads events; only the worker thread touches the models.
Events reach the request's asyncio queue through loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..api import DEFAULT_TREE, Engine
from ..decode.batch import batch_forward
from ..decode.engine import GenerationConfig, PlainDecoding, SpeculativeDecoding
from ..decode.fallback import DriftMonitor, ForwardCosts, RequestState, regime_of, shape_key
from ..decode.lookup import ChainPlanner, LookupSettings
from ..decode.propose import EagleProposer
from ..decode.round import BatchDecoder, RoundResult
from ..decode.sampling import SamplingParams
from ..decode.tree import DraftTree, TreeShape
from .metrics import ServerMetrics

log = logging.getLogger("anchorspec.serve")

# The shapes `anchorspec serve` chooses among per round when no shape is given, beside the starting one (the default
# tree, or a tuned shape): a batch's best draft is shallower than a lone request's. On the AMX Xeon (round 24, bf16,
# 1 thread, session 81) the calibration's break-even tau*(4) was 1.29 for a chain of 2 (expected tau ~1.7) and 2.49
# for the 4,4,16 tree (~2.3); at 16 rows no shape paid (chain of 1: 1.53 against ~1.47).
BATCH_SHAPES = tuple(TreeShape.chain(depth) for depth in (1, 2, 3, 4))
# The dummy prompt's length when the shapes are calibrated: a round's cost grows with its rows' contexts, and on
# 16-token prompts a round of 16 rows priced at 31 ms (plain) and 52 ms (3 tokens a row) cost 41-46 and 73-107 ms
# in MT-bench traffic; on 256-token prompts 44 and 83 (AMX Xeon, bf16, 1 thread, session 81). A fixed shape's
# server still calibrates on 16 tokens (not re-measured).
CALIBRATION_CONTEXT = 256


class Handle:
    """The submitter's side of a request: `queue` of events, and `cancel()`.

    Events: ("tokens", [ids]), ("done", GenerationResult), ("error", message).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, wake):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop, self._wake = loop, wake
        self.cancelled = threading.Event()
        self.switches = 0  # drift fallback switches of this request

    def cancel(self) -> None:
        """Free the sequence before its next step (client gone, or request abandoned)."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._wake()

    def _put(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass
class _Sequence:
    handle: Handle
    decoding: PlainDecoding | SpeculativeDecoding
    monitor_state: RequestState | None
    submitted: float
    first_token: float | None = None
    tokens: int = field(default=0)


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, monitor: DriftMonitor | None = None,
                 shape: TreeShape | None = None, max_running: int = 16, calibrate: bool = True,
                 lookup: LookupSettings | None = None, shapes: tuple[TreeShape, ...] | None = None):
        """`shapes`: the draft shapes each round chooses among by its row count (DriftMonitor.shape_for_rows; `shape`,
        the one a round starts with, is one of them); None: every round drafts `shape`. `lookup`: merge a
        context-lookup chain into every request's drafts (decode/lookup.py). None here;
        `anchorspec serve` turns it on with a drafter (cli.serve_lookup: measured under load in session 70).
        With no drafter it is prompt lookup: each request drafts the chain copied from its own text alone, and
        each round caps the chains at the length that the forward costs calibrated at start-up and the chains'
        learned acceptance say pays (ChainPlanner)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.monitor = monitor or DriftMonitor()
        self.shape = shape or DEFAULT_TREE
        self.max_running = max_running
        self.lookup = lookup
        self.speculative = engine.drafter is not None
        self.shapes = tuple(dict.fromkeys((self.shape, *shapes))) if shapes and self.speculative else (self.shape,)
        if len(self.shapes) > 1:  # the monitor prices each shape apart, and learns the drafter's acceptance to choose
            self.monitor.shapes, self.monitor.shape = self.shapes, self.shape
        # prompt lookup: no drafter, chains copied from each request's text, priced per round on forward costs
        # measured together at start-up (calibrate_widths), not learned from traffic: rounds are mostly plain,
        # so traffic would refresh the 1-wide cost alone, and a host that slowed since would price every chain
        # as cheaper than it is (session 76: the plain server's 16-user rate drifted from 201 to 145 tok/s)
        prompt_lookup = lookup is not None and not self.speculative
        self.widths = ForwardCosts(smoothing=1.0) if prompt_lookup else None
        self.chains = ChainPlanner(self.widths.between_widths) if prompt_lookup else None
        self._calibrate_first = calibrate and (self.speculative or self.chains is not None)
        self.decoder = BatchDecoder(engine.target)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._rode = True  # whether every row of the latest batched round drafted (else some drafters catch up)
        self.ready = threading.Event()  # set once calibration is done and the loop runs

    # --- control --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="anchorspec-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    # --- submission (event-loop thread) ---------------------------------------------------------
    def submit(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue a request; raises AnchorspecError for a prompt the target cannot take."""
        cfg = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingParams(temperature, top_p), seed=seed,
                               stop_token_ids=self.engine.stop_token_ids())
        target = self.engine.target
        if self.speculative:  # each sequence owns a proposer: the drafter's KV cache is per sequence
            decoding = SpeculativeDecoding(target, EagleProposer(self.engine.drafter), prompt_ids, cfg, self.shape,
                                           lookup=self.lookup)
        elif self.chains is not None:
            decoding = SpeculativeDecoding(target, None, prompt_ids, cfg, None, lookup=self.lookup)
        else:
            decoding = PlainDecoding(target, prompt_ids, cfg)
        handle = Handle(loop or asyncio.get_running_loop(), self._wake)
        seq = _Sequence(handle, decoding, None, time.perf_counter())
        with self._cond:
            self._waiting.append(seq)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return handle

    # --- worker thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        if self._calibrate_first:
            try:
                self.calibrate()
            except Exception:  # calibration is an optimisation; the monitor then learns from traffic
                log.exception("calibration failed")
        self._update_gauges()
        self.ready.set()
        while True:
            with self._cond:
                while not self._stop and not self._running and not self._waiting:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
            self.step()
        for seq in list(self._running) + list(self._waiting):
            seq.handle._put(("error", "the server is shutting down"))
        self._running.clear()
        self._waiting.clear()

    def step(self) -> None:
        """One iteration of the worker: admit waiting requests, drop cancelled ones, run one round.
        The worker thread calls it; a benchmark or test that drives the scheduler from its own
        thread (no `start()`) may call it instead."""
        with self._cond:
            self._admit()
        for seq in list(self._running):
            if seq.handle.cancelled.is_set():
                self._finish(seq, "cancelled")
        if self._running:
            try:
                self._round()
            except Exception:  # a bug in the scheduler's own bookkeeping: without this the worker thread
                # would die and every request, this one and all later ones, would hang unanswered
                log.exception("scheduler round failed")
                for seq in list(self._running):
                    seq.handle._put(("error", "generation failed: internal scheduler error"))
                    self._finish(seq, "error")
        self._update_gauges()

    def _admit(self) -> None:
        joined = [seq.monitor_state for seq in self._running if seq.monitor_state is not None]
        batch_plain = bool(joined) and not any(state.speculating for state in joined)
        admitted = []
        while self._waiting and len(self._running) < self.max_running:
            seq = self._waiting.popleft()
            if seq.handle.cancelled.is_set():
                self.metrics.requests.labels("cancelled").inc()
                continue
            self.metrics.prompt_tokens.inc(seq.decoding.stats.prompt_tokens)
            self._running.append(seq)
            admitted.append(seq)
        for seq in admitted if self.speculative else ():  # judged at the batch size they join
            seq.monitor_state = self.monitor.new_request(rows=len(self._running), batch_plain=batch_plain,
                                                         regime=regime_of(seq.decoding.cfg.sampling))
            if not seq.monitor_state.speculating:
                self._count_switch(seq, "off")

    def _round(self) -> None:
        running = list(self._running)
        retried: set[int] = set()
        if self.speculative:
            retried = {id(state) for state in self.monitor.start_round([seq.monitor_state for seq in running])}
            for seq in running:
                if id(seq.monitor_state) in retried:
                    self._count_switch(seq, "on")
        # one speculating row pads every batched row to its tree's width: the rows switched off then draft
        # too (drafting is batched, so nearly free), rather than pay the width for one token. So a round
        # is all-plain or all-speculative, the shape the break-even tau*(B) prices, and whether it
        # speculates is the batch's decision, not any one row's; only a batch still learning whether it
        # pays runs its speculating rows in a forward apart (DriftMonitor.round_plan).
        batched = [seq.monitor_state for seq in running if seq.monitor_state is not None and seq.decoding.batched]
        shape = self._choose_shape(batched)
        plan = self.monitor.round_plan(batched, probing=any(id(state) in retried for state in batched)) \
            if self.speculative else []
        if batched and not any(plan):
            vetoed = {id(state) for state in self.monitor.veto(batched)}
            for seq in running:
                if id(seq.monitor_state) in vetoed:
                    self._count_switch(seq, "off")
        speculates = {id(state): on for state, on in zip(batched, plan)}
        items = [(seq.decoding, None if seq.monitor_state is None
                  else speculates[id(seq.monitor_state)] if seq.decoding.batched else seq.monitor_state.speculating)
                 for seq in running]
        split = any(plan) and not all(plan)
        try:
            # a copied chain merged into one row's tree widens every row's forward: with shapes chosen per batch size,
            # only a lone request's round merges them (4 users: 1.22x the plain server without, 1.11x with; session 81)
            result = self.decoder.round(items, split=split, chains=self.chains and self.chains.cap, shape=shape,
                                        lookup=shape is None or len(batched) <= 1)
        except Exception as exc:  # a bug outside any one sequence: fail this round's requests, keep serving
            log.exception("decoding round failed")
            result = RoundResult([exc] * len(running))
        self.metrics.observe_round(result)
        if not result.one_off:  # a round that compiled a graph or grew a cache is not what a round costs
            self.monitor.observe_round(result.rows, result.width, result.forward_s, result.draft_rows, result.draft_s,
                                       catch_up=any(plan) and not self._rode, forwards=result.forwards)
        if batched:  # a round of prefills only leaves the drafters as they were
            self._rode = all(plan)
        if self.speculative and result.rows:
            tstar = self.monitor.threshold_at(result.rows)
            if tstar is not None:
                self.metrics.round_break_even_tau.observe(tstar)
        for seq, report in zip(running, result.reports):
            self._deliver(seq, report, shape)

    def _choose_shape(self, batched: list[RequestState]) -> TreeShape | None:
        """The draft shape of a round of the `batched` rows (None: the sequences' own, with one shape to draft): of
        the scheduler's shapes, the one expected fastest at that row count, judged on its most common sampling
        regime's acceptance; a lone request's, the scheduler's own shape (tuned or default, as `generate` drafts;
        chosen among the others at one user it ran 1.27x the plain server against the tree's 1.31x, session 81).
        A new shape forgets the rows' windows: their accepted lengths were another shape's."""
        if len(self.shapes) == 1 or not batched:
            return None
        self.monitor.regime = Counter(state.regime for state in batched).most_common(1)[0][0]
        chosen = self.shape if len(batched) == 1 else self.monitor.shape_for_rows(len(batched), self.shapes)
        if chosen != self.monitor.shape:
            for state in batched:
                state.window.clear()
            self.monitor.shape = chosen
            self.metrics.shape_changes.labels(shape_key(chosen)).inc()
        return self.monitor.shape

    def _deliver(self, seq: _Sequence, report, shape: TreeShape | None = None) -> None:
        if isinstance(report, BaseException):  # one bad sequence must not take the server down
            log.error("generation step failed", exc_info=report)
            seq.handle._put(("error", f"generation failed: {type(report).__name__}: {report}"))
            self._finish(seq, "error")
            return
        state = seq.monitor_state
        self.metrics.observe_step(report)
        if self.chains is not None and report.kind == "lookup":
            self.chains.learn(seq.decoding.cfg.sampling.greedy, report.lookup_found, report.drafted, report.accepted)
        if state is not None and shape is not None and report.kind == "speculative":  # what the shapes are priced on
            self.monitor.regime = state.regime
            self.monitor.learn_acceptance(None if shape.is_chain else shape, report.drafter_depth,
                                          report.drafter_accepted, report.top_ranked, report.top_depth)
        if state is not None:
            switch = self.monitor.record(state, report.kind, report.accepted, len(report.tokens))
            if switch:
                self._count_switch(seq, switch)
        if report.tokens:
            if seq.first_token is None:
                seq.first_token = time.perf_counter()
                self.metrics.ttft.observe(seq.first_token - seq.submitted)
            seq.handle._put(("tokens", report.tokens))
        if seq.decoding.finished:
            seq.handle._put(("done", seq.decoding.result()))
            self.metrics.latency.observe(time.perf_counter() - seq.submitted)
            self._finish(seq, "ok")

    def _finish(self, seq: _Sequence, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.decoder.release(seq.decoding)  # its KV slot goes back to the batch
        self._running.remove(seq)  # drops the drafter cache with the last reference

    def _count_switch(self, seq: _Sequence, direction: str) -> None:
        seq.handle.switches += 1
        self.metrics.fallback_switches.labels(direction).inc()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self._running))
        m.waiting.set(len(self._waiting))
        m.speculating.set(sum(1 for s in self._running if s.monitor_state is not None and s.monitor_state.speculating))
        m.speculation_enabled.set(1 if self.speculative and self.monitor.global_speculating else 0)
        tstar, tau = self.monitor.threshold, self.monitor.global_tau
        m.break_even_tau.set(float("nan") if tstar is None else tstar)
        m.rolling_tau.set(float("nan") if tau is None else tau)

    def calibrate(self, steps: int = 3, batches: tuple[int, ...] = (1, 4)) -> None:
        """Seed the monitor's cost lines with a few plain and speculative rounds on a dummy prompt at
        each batch size (with shapes to choose from: each shape, at a full batch too), through the batched
        path, on a BatchDecoder of its own (with no drafter: the
        target's forwards at the widths a copied chain verifies, calibrate_widths, up to a full batch)."""
        if self.chains is not None:
            self.calibrate_widths(steps, tuple(sorted({*batches, self.max_running})))
            return
        choosing, current = len(self.shapes) > 1, self.monitor.shape
        if choosing:  # each shape at a full batch too: its cost there is not the line through small batches'
            batches = tuple(sorted({*batches, self.max_running}))
        cfg = GenerationConfig(max_new_tokens=1 + steps + (steps + 1) * (max(s.depth for s in self.shapes) + 1) + 1)
        for shape in self.shapes:
            if choosing:
                self.monitor.shape = shape  # its drafting and width are learned apart
            for rows in batches:
                with self._dummy_batch(rows, cfg, context=CALIBRATION_CONTEXT if choosing else 16) as (decoder, decs):
                    kinds = [True] + [False] * steps + [True] * (steps + 1)  # prefills, plain, speculative
                    for k, speculate in enumerate(kinds):
                        result = decoder.round([(dec, speculate) for dec in decs if not dec.finished],
                                               shape=shape if choosing else None)
                        failed = [r for r in result.reports if isinstance(r, BaseException)]
                        if failed:
                            raise failed[0]
                        if not result.one_off:
                            self.monitor.observe_round(result.rows, result.width, result.forward_s, result.draft_rows,
                                                       result.draft_s,
                                                       catch_up=k > 0 and speculate and not kinds[k - 1])
        self.monitor.shape = current

    @contextmanager
    def _dummy_batch(self, rows: int, cfg: GenerationConfig, plain: bool = False, context: int = 16):
        """`rows` decodings of a `context`-token dummy prompt (drafting with the engine's drafter, or `plain`) on a
        BatchDecoder of their own, their slots released on the way out."""
        target = self.engine.target
        prompt = [i % target.vocab_size for i in range(context)]
        decs = [PlainDecoding(target, prompt, cfg) if plain
                else SpeculativeDecoding(target, EagleProposer(self.engine.drafter), prompt, cfg, self.shape)
                for _ in range(rows)]
        decoder = BatchDecoder(target)
        try:
            yield decoder, decs
        finally:
            for dec in decs:
                decoder.release(dec)

    def calibrate_widths(self, repeats: int = 3, batches: tuple[int, ...] = (1, 4)) -> None:
        """Seed forward(rows, width) for prompt lookup: at each batch size, the median of `repeats` timed target
        forwards (after a warm-up round) of chains as wide as a copied chain verifies (1 token up to the longest
        chain + 1, a few widths between, interpolated: ForwardCosts.between_widths), over sequences
        prefilled on a dummy prompt in a BatchDecoder of its own. Nothing is committed. A full batch is
        measured, not extrapolated from small ones: at 16 rows a 5-wide forward took 170 ms where the line
        through 1 and 4 rows said 124 (bf16, 1 thread, session 76), and a round priced on that verified chains
        at a loss."""
        target = self.engine.target
        longest = self.lookup.max_tokens + 1
        widths = sorted({1, 2, 4, 8, longest} & set(range(1, longest + 1)))
        for rows in batches:
            with self._dummy_batch(rows, GenerationConfig(max_new_tokens=2), plain=True) as (decoder, decs):
                decoder.round([(dec, None) for dec in decs])  # the prefills
                slots = [dec.cache for dec in decs]
                samples: dict[int, list[float]] = {width: [] for width in widths}
                for _ in range(repeats + 1):  # widths interleaved: a slow second on the host spreads over all
                    for width in widths:
                        trees = [DraftTree.chain(torch.arange(width) % target.vocab_size) for _ in decs]
                        t = time.perf_counter()
                        batch_forward(target, slots, trees)
                        samples[width].append(time.perf_counter() - t)
                for width in widths:
                    self.widths.add(rows, width, statistics.median(samples[width][1:]))  # the first: a warm-up
