"""Rounds of batched decoding: every sequence advances one step, and the round's target work on
already-started sequences is ONE forward.

A round over step-able decodings (PlainDecoding / SpeculativeDecoding, decode/engine.py):
  1. a sequence that has not started prefills alone (batch 1, on its own DynamicCache), then moves
     into a slot of the shared BatchKV; it joins the batched forward from the next round on (a
     cache with sliding-window layers cannot move: that sequence keeps stepping alone, as before);
  2. every other sequence prepares: it drafts (per sequence: drafting is not batched) or, for a
     plain step, offers its pending token as a 1-node tree;
  3. one target forward over all prepared trees, padded (decode/batch.py);
  4. each sequence finishes on its own rows: verify, commit into its slot, emit, count.
Per sequence the steps, random draws and commits are those of its solo run, so outputs equal the
solo outputs (greedy exactly; seeded sampling too, up to float rounding of the batched forward).

Failures stay with their sequence: an exception in one sequence's prepare or finish is that
sequence's result and the others go on; if the batched forward itself raises, each row is re-run
alone (a forward commits nothing, so re-running is safe) and only rows that fail alone fail.

Timing in each StepReport: draft_s is the sequence's own drafting (what its speculation adds to
the round); verify_s is the whole batched forward it rode in (what the round's verification costs
every sequence in it). A plain row pays the same forward, so the drift monitor compares
speculative and plain step costs measured under the same load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..models.target import Target
from .batch import BatchKV, batch_forward
from .engine import _Decoding


@dataclass
class RoundResult:
    reports: list  # per input sequence, in order: a StepReport, or the exception that ended it
    prefills: int = 0  # sequences that prefilled alone this round
    solo: int = 0  # steps run alone: sequences whose cache a BatchKV cannot hold (sliding-window layers)
    rows: int = 0  # sequences in the batched forward (0: no batched forward this round)
    width: int = 0  # padded new tokens per row
    tokens: int = 0  # real new tokens in the batched forward
    forward_s: float = 0.0
    isolated: list[int] = field(default_factory=list)  # rows re-run alone after the batched forward failed


class BatchDecoder:
    """Owns the shared BatchKV; `round(items)` advances every item by one step."""

    def __init__(self, target: Target, kv: BatchKV | None = None):
        self.target = target
        self.kv = kv or BatchKV()

    def round(self, items: list[tuple[_Decoding, bool | None]]) -> RoundResult:
        """`items`: (decoding, speculate) with speculate None for a PlainDecoding. Finished
        decodings must not be passed; a decoding that fails is released here."""
        reports: list = [None] * len(items)
        result = RoundResult(reports)
        prepared = []  # (item index, tree)
        for i, (dec, speculate) in enumerate(items):
            try:
                if not dec.started:
                    reports[i] = dec.step()
                    result.prefills += 1
                    if not dec.finished and BatchKV.accepts(dec.cache):
                        dec.use_slot(self.kv.attach(dec.cache))
                elif not dec.batched:  # its cache cannot join the batch: it keeps stepping alone
                    reports[i] = dec.step() if speculate is None else dec.step(speculate)
                    result.solo += 1
                else:
                    prepared.append((i, dec.prepare() if speculate is None else dec.prepare(speculate)))
            except Exception as exc:  # noqa: BLE001 - reported to that sequence only
                reports[i] = exc
                self.release(dec)
        if prepared:
            self._forward(items, prepared, result)
        return result

    def _forward(self, items, prepared, result: RoundResult) -> None:
        slots = [items[i][0].cache for i, _ in prepared]
        trees = [tree for _, tree in prepared]
        t = time.perf_counter()
        try:
            outs = [batch_forward(self.target, slots, trees)]
            groups = [prepared]
        except Exception:  # noqa: BLE001 - isolate the row that breaks the batch
            outs, groups = [], []
            for b, row in enumerate(prepared):
                try:
                    outs.append(batch_forward(self.target, [slots[b]], [trees[b]]))
                    groups.append([row])
                except Exception as exc:  # noqa: BLE001
                    result.reports[row[0]] = exc
                    self.release(items[row[0]][0])
            result.isolated = [i for i, _ in prepared]
        result.forward_s = time.perf_counter() - t
        sizes = [tree.size for tree in trees]
        result.rows, result.width, result.tokens = len(prepared), max(sizes), sum(sizes)
        for out, group in zip(outs, groups):
            for b, (i, _) in enumerate(group):
                dec = items[i][0]
                try:
                    result.reports[i] = dec.finish(out.logits[b], out.aux[b], result.forward_s)
                except Exception as exc:  # noqa: BLE001
                    result.reports[i] = exc
                    self.release(dec)
                    continue
                if dec.finished:
                    self.release(dec)

    def release(self, decoding: _Decoding) -> None:
        """Free the decoding's slot (finished, cancelled or failed); a no-op if it has none."""
        if decoding.batched and not decoding.cache.released:
            decoding.cache.release()
