"""Rounds of batched decoding: every sequence advances one step; the round's drafting is one
drafter forward per draft level and its verification ONE target forward, over all sequences.

A round over step-able decodings (PlainDecoding / SpeculativeDecoding, decode/engine.py):
  1. a sequence that has not started takes a slot of the shared BatchKV and prefills alone into it
     (a batch of one), then its drafter cache moves into a slot of the drafter's; it joins the
     batched forwards from the next round on (a target with sliding-window layers cannot use a
     slot: that sequence keeps stepping alone on its DynamicCache);
  2. every other sequence drafts: its drafting program (decode/drafting.py) advances in lockstep
     with the others', so the passes of one draft level (the context update, then each tree level
     or chain step) of all sequences are one padded drafter forward; a plain step drafts nothing
     and offers its pending token as a 1-node tree;
  3. one target forward over all prepared trees, padded (decode/batch.py); or, with `split`, one
     over the plain rows' 1-node trees and one over the others, so that a few speculating rows do
     not pad every plain row to their width (the server's cheap probes: decode/fallback.py);
  4. each sequence finishes on its own rows: verify, commit into its slot, emit, count.
Per sequence the steps, random draws and commits are those of its solo run, so outputs equal the
solo outputs (greedy exactly; seeded sampling too, up to float rounding of the batched forward).

Failures stay with their sequence: an exception in one sequence's drafting or finish is that
sequence's result and the others go on; if a batched forward itself raises, each row is re-run
alone (it commits nothing before it succeeds, so re-running is safe) and only rows that fail alone
fail.

Timing in each StepReport: draft_s is the drafting the sequence rode in, from its first drafter
pass to its last (forwards shared with the other drafting sequences); verify_s is the whole batched
target forward it rode in. The drift monitor prices whole rounds instead (RoundResult: rows, width,
forward_s, draft_rows, draft_s; decode/fallback.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..models.target import Target
from .batch import BatchKV, batch_forward, one_offs
from .drafting import run_lockstep
from .engine import SpeculativeDecoding, full_attention
from .tree import DraftTree, TreeShape


@dataclass
class RoundResult:
    reports: list  # per input sequence, in order: a StepReport, or the exception that ended it
    prefills: int = 0  # sequences that prefilled alone this round
    solo: int = 0  # steps run alone: sequences whose cache a BatchKV cannot hold (sliding-window layers)
    rows: int = 0  # sequences in the batched forward(s) (0: no batched forward this round)
    width: int = 0  # padded new tokens per row (the widest forward's, when split)
    tokens: int = 0  # real new tokens in the batched forward(s)
    forward_s: float = 0.0
    forwards: list = field(default_factory=list)  # each batched forward: (rows, padded width, seconds)
    compiled: bool = False  # a graph compiled during the round (a compiled target or drafter)
    one_off: bool = False  # ... or that, or a KV cache grew (batch.one_offs): the round is no cost sample
    draft_passes: int = 0  # lockstep drafter levels this round (each: one forward per drafter and cache)
    draft_rows: int = 0  # most sequences in one of them
    draft_s: float = 0.0  # wall time of the round's drafting
    isolated: list[int] = field(default_factory=list)  # rows re-run alone after the batched forward failed


class BatchDecoder:
    """Owns the shared BatchKV; `round(items)` advances every item by one step."""

    def __init__(self, target: Target, kv: BatchKV | None = None):
        self.target = target
        self.kv = kv or BatchKV()
        self.draft_kv: dict[int, BatchKV] = {}  # id(drafter) -> the drafter caches of its sequences

    def round(self, items: list[tuple[SpeculativeDecoding, bool | None]], split: bool = False,
              chains=None, shape: TreeShape | None = None, lookup: bool = True) -> RoundResult:
        """`items`: (decoding, speculate) with speculate None for a PlainDecoding. Finished
        decodings must not be passed; a decoding that fails is released here. `split`: the rows
        offering a 1-node tree (plain steps) get a target forward of their own, apart from the trees.
        `chains`: for rows whose draft is a copied chain alone (prompt lookup), the cap on their copied
        tokens, a function of (rows in the forward, [(greedy, chain length)] of those rows that found a
        chain), e.g. ChainPlanner.cap (decode/lookup.py); None: every chain is verified whole. `shape`: the draft
        shape of the round's speculating rows (None: each sequence's own); `lookup` False: they draft without
        their lookup chains."""
        reports: list = [None] * len(items)
        result, paid = RoundResult(reports), one_offs()
        programs = []  # (item index, drafting program)
        for i, (dec, speculate) in enumerate(items):
            try:
                if not dec.started:
                    if full_attention(dec.target):
                        dec.join(self.kv)
                    reports[i] = dec.step()
                    result.prefills += 1
                    if dec.finished:
                        self.release(dec)
                    elif dec.batched:
                        self._attach_drafter(dec)
                elif not dec.batched:  # its cache cannot join the batch: it keeps stepping alone
                    reports[i] = dec.step() if speculate is None else dec.step(speculate, shape)
                    result.solo += 1
                else:
                    programs.append((i, dec.draft() if speculate is None else dec.draft(speculate, shape, lookup)))
            except Exception as exc:  # noqa: BLE001 - reported to that sequence only
                reports[i] = exc
                self.release(dec)
        prepared = self._draft(items, programs, result)
        if chains is not None:
            prepared = self._cap_chains(items, prepared, chains)
        groups = [prepared]
        if split:
            groups = [[row for row in prepared if row[1].size == 1], [row for row in prepared if row[1].size > 1]]
        for group in groups:
            if group:
                self._forward(items, group, result)
        now = one_offs()
        result.compiled, result.one_off = now[0] != paid[0], now != paid
        return result

    def _attach_drafter(self, dec: SpeculativeDecoding) -> None:
        """Move a prefilled sequence's drafter cache, if it drafts in passes, into a slot of the
        shared drafter cache (one drafter BatchKV per drafter)."""
        proposer = getattr(dec, "proposer", None)
        if hasattr(proposer, "use_slot"):
            kv = self.draft_kv.setdefault(id(proposer.drafter), BatchKV())
            proposer.use_slot(kv.attach_rows(*proposer.cache_rows()))

    def _draft(self, items, programs, result: RoundResult) -> list[tuple[int, DraftTree]]:
        """Run the drafting programs in lockstep; returns (item index, tree) of those that succeeded."""
        t = time.perf_counter()
        lockstep = run_lockstep([program for _, program in programs])
        result.draft_s = time.perf_counter() - t
        result.draft_passes, result.draft_rows = lockstep.levels, lockstep.widest
        prepared = []
        for (i, _), out in zip(programs, lockstep.results):
            if isinstance(out, Exception):
                result.reports[i] = out
                self.release(items[i][0])
            else:
                prepared.append((i, out))
        return prepared

    @staticmethod
    def _cap_chains(items, prepared, chains) -> list[tuple[int, DraftTree]]:
        lengths = [items[i][0].pending_chain() for i, _ in prepared]
        found = [(items[i][0].cfg.sampling.greedy, n) for (i, _), n in zip(prepared, lengths) if n]
        if not found:
            return prepared
        cap = chains(len(prepared), found)
        return [(i, items[i][0].cap_chain(cap) if n > cap else tree) for (i, tree), n in zip(prepared, lengths)]

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
            result.isolated += [i for i, _ in prepared]
        seconds, sizes = time.perf_counter() - t, [tree.size for tree in trees]
        result.forwards.append((len(prepared), max(sizes), seconds))
        result.forward_s += seconds
        result.rows, result.width, result.tokens = (result.rows + len(prepared), max(result.width, max(sizes)),
                                                    result.tokens + sum(sizes))
        for out, group in zip(outs, groups):
            for b, (i, _) in enumerate(group):
                dec = items[i][0]
                try:
                    result.reports[i] = dec.finish(out.logits[b], out.aux[b], seconds)
                except Exception as exc:  # noqa: BLE001
                    result.reports[i] = exc
                    self.release(dec)
                    continue
                if dec.finished:
                    self.release(dec)

    def release(self, decoding: SpeculativeDecoding) -> None:
        """Free the decoding's slots (finished, cancelled or failed); a no-op if it has none."""
        for slot in decoding.slots():
            if not slot.released:
                slot.release()
