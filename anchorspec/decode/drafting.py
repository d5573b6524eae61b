"""Drafter passes: drafting written once as a program, run alone or in lockstep with other sequences.

A proposer drafts by yielding DraftPass requests (one drafter forward each) and receiving their
PassOutput; the program returns its DraftTree. Who runs the passes decides batching:
  - `run_lockstep(programs)` (a BatchDecoder round, decode/round.py) advances all programs
    together: the passes of all sequences at the same level become ONE padded drafter forward
    (`run_passes`) over their slots of a shared drafter BatchKV;
  - `run_program(program)` is a lockstep of one: each pass on the sequence's own one-slot BatchKV
    (a batch of one through the same padded forward).

Rows of a drafter cache: `committed` real rows (positions with target features), then, while a
draft is being built, speculative rows (drafted tokens). A pass writes its n rows right after the
`past` rows already there. A context pass (target features, `aux`) extends the committed rows; a
draft pass (fed-back hidden states, `x_in`) writes speculative rows that the proposer drops
when the draft is done (they are scratch past the slot's length).

Attention of a pass: `block` [n, w] over the last w keys (the newest past rows and the n new
ones); every earlier key is visible. None = causal (a context pass, or a chain step: one query
that sees everything before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch

from ..errors import AnchorspecError
from ..models.compiled import GRAPH_PREFILL_TOKENS
from ..models.drafter import Eagle3Drafter
from ..models.masks import CAUSAL, additive_mask
from .batch import ForwardCache, KVSlot, inverse, padded_allowed, slot_order, static_slots

WIDE = 32  # passes with more new tokens (a prompt, a long plain stretch) batch only with passes of similar size


@dataclass
class DraftPass:
    drafter: Eagle3Drafter
    cache: KVSlot
    past: int  # rows already in the cache (committed + speculative so far)
    tokens: torch.Tensor  # [n] target token ids
    positions: torch.Tensor  # [n]
    aux: torch.Tensor | None = None  # [n, n_aux * Ht] target features: a context pass
    x_in: torch.Tensor | None = None  # [n, H] fed-back hidden states: a draft pass
    block: torch.Tensor | None = None  # [n, w] bool, see the module docstring; None = causal

    def __post_init__(self):
        if (self.aux is None) == (self.x_in is None):
            raise AnchorspecError("a drafter pass takes target features (context) or fed-back hidden states (draft)")

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def is_context(self) -> bool:
        """Context rows stay in the cache; only the last row's outputs are returned."""
        return self.aux is not None

    def allowed_block(self) -> torch.Tensor:
        n = self.size
        return self.block if self.block is not None else torch.ones(n, n, dtype=torch.bool).tril()


@dataclass
class PassOutput:
    logits: torch.Tensor  # [m, draft vocab] float32; m = 1 for a context pass (its last row), else n
    hidden: torch.Tensor  # [m, H] the fed-back hidden state of the same rows
    state_norm: torch.Tensor  # [m] float32: L2 norm of the raw residual output h (grows as a draft drifts)


def state_norms(h: torch.Tensor) -> torch.Tensor:
    return h.float().norm(dim=-1)


Program = Generator[DraftPass, PassOutput, object]


@torch.inference_mode()
def run_program(program: Program):
    """Run one program alone (a lockstep of one); returns its result or raises its exception.
    (Programs hold no inference_mode of their own: a context manager open across a yield would
    leak into the caller's code between passes. Their drivers run them under it.)"""
    (result,) = run_lockstep([program]).results
    if isinstance(result, Exception):
        raise result
    return result


@dataclass
class Lockstep:
    results: list  # per program: what it returned, or the exception that ended it
    levels: int  # calls of run_passes
    widest: int  # most passes in one call


@torch.inference_mode()
def run_lockstep(programs: list[Program]) -> Lockstep:
    """Advance all programs together: each call of run_passes takes the next pass of every program
    still running (one padded drafter forward per drafter), until all have returned."""
    results: list = [None] * len(programs)
    waiting: dict[int, DraftPass] = {}
    levels = widest = 0

    def advance(i: int, out: PassOutput | None) -> None:
        try:
            waiting[i] = programs[i].send(out)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as exc:  # noqa: BLE001 - that program's result
            results[i] = exc

    for i in range(len(programs)):
        advance(i, None)
    while waiting:
        level, waiting = list(waiting.items()), {}
        outs = run_passes([request for _, request in level])
        levels, widest = levels + 1, max(widest, len(level))
        for (i, _), out in zip(level, outs):
            if isinstance(out, Exception):
                programs[i].close()
                results[i] = out
            else:
                advance(i, out)
    return Lockstep(results, levels, widest)


@torch.inference_mode()
def run_passes(passes: list[DraftPass]) -> list[PassOutput | Exception]:
    """Run passes of different sequences; outputs in order. Passes on slots of one BatchKV with the
    same drafter share one padded forward: all passes of up to WIDE tokens, and wider ones by
    power-of-two size class (so padding at most doubles a wide pass), or all of them through a compiled
    drafter's graph (_forward_groups). A pass that fails alone gets its exception; a failed shared forward
    is retried pass by pass."""
    shared: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(passes):
        shared.setdefault((id(p.drafter), id(p.cache.kv)), []).append(i)
    groups = [group for members in shared.values() for group in _forward_groups(passes, members)]
    outs: list = [None] * len(passes)
    for members in groups:
        try:
            for i, out in zip(members, _forward([passes[i] for i in members])):
                outs[i] = out
        except Exception as exc:  # noqa: BLE001 - reported to that sequence, or isolated below
            if len(members) == 1:
                outs[members[0]] = exc
                continue
            for i in members:
                try:
                    outs[i] = _forward([passes[i]])[0]
                except Exception as exc:  # noqa: BLE001
                    outs[i] = exc
    return outs


def _forward_groups(passes: list[DraftPass], members: list[int]) -> list[list[int]]:
    """The forwards that passes on one cache (`members`) take: one, where a compiled drafter's graph runs them
    all (`_one_graph_forward`), else all passes of up to WIDE tokens together and wider ones by size class."""
    if _one_graph_forward([passes[i] for i in members]):
        return [members]
    classes: dict[int, list[int]] = {}
    for i in members:
        classes.setdefault(0 if passes[i].size <= WIDE else passes[i].size.bit_length(), []).append(i)
    return list(classes.values())


def _one_graph_forward(group: list[DraftPass]) -> bool:
    """Whether a compiled drafter runs these passes as one static forward through its graph: they fill slots
    0..B-1 of their cache or one slot (static_slots), none is wider than the prompts a target's graph takes
    (GRAPH_PREFILL_TOKENS: SDPA's causal kernel wins above), and padding all to the widest at most doubles the
    tokens, as a size class would. A server's catch-up (every row's drafter reading the positions it missed in
    plain rounds, its prompt too) ran eager in size classes at 9-12k positions/s, as much time in elementwise
    kernels as in GEMMs (16 rows, 116-202 positions each; AMX Xeon, bf16, 1 thread, session 86)."""
    drafter = group[0].drafter
    if not drafter.compiled:  # an eager drafter's passes (every level of every round) need no more
        return False
    sizes = [p.size for p in group]
    width = max(sizes)
    return (static_slots(sorted(p.cache.index for p in group), drafter.aot) and width <= GRAPH_PREFILL_TOKENS
            and max(p.past for p in group) + width >= 2 and width * len(group) <= 2 * sum(sizes))


def _forward(passes: list[DraftPass]) -> list[PassOutput]:
    """One padded drafter forward over passes on slots of one BatchKV (the layout of decode/batch.py:
    row b's new tokens at its rows past_b + j, per-row positions, mask from the blocks)."""
    drafter = passes[0].drafter
    kv = passes[0].cache.kv
    for p in passes:
        kv.check(p.cache)
        if p.past < p.cache.length:
            raise AnchorspecError(f"drafter pass after {p.past} rows, but the slot holds {p.cache.length} committed")
    order = slot_order([p.cache.index for p in passes])
    if order is not None:  # rows in slot order, so the cache is read through views (decode/batch.py)
        outs = _forward([passes[b] for b in order])
        return [outs[k] for k in inverse(order)]
    past = [p.past for p in passes]
    width = max(p.size for p in passes)
    kv_len = max(past) + width  # ForwardCache makes room for it
    dtype, hidden = drafter.fc.weight.dtype, drafter.config.hidden_size
    B, device = len(passes), drafter.fc.weight.device
    alone = passes[0] if B == 1 else None
    if alone is not None:  # a batch of one needs no padding: its own tensors are the inputs
        ids, pos = alone.tokens[None].to(device), alone.positions[None].to(device)
        x = (drafter.project_features(alone.aux) if alone.is_context else alone.x_in.to(dtype))[None].to(device)
    else:
        ids = torch.zeros(B, width, dtype=torch.long, device=device)
        pos = torch.tensor(past, dtype=torch.long, device=device)[:, None].repeat(1, width)
        x = torch.zeros(B, width, hidden, dtype=dtype, device=device)
        context = [b for b, p in enumerate(passes) if p.is_context]
        if context:  # one fc over every context pass's features
            projected = drafter.project_features(torch.cat([passes[b].aux for b in context])).split(
                [passes[b].size for b in context])
            for b, feats in zip(context, projected):
                x[b, :feats.shape[0]] = feats
        for b, p in enumerate(passes):
            ids[b, :p.size], pos[b, :p.size] = p.tokens, p.positions
            if not p.is_context:
                x[b, :p.size] = p.x_in
    indices = [p.cache.index for p in passes]
    # a compiled drafter runs passes on slots 0..B-1 or one slot as static forwards (always a mask), as a compiled
    # target runs its steps (decode/batch.py): those past the prompt, and a prompt or catch-up that run_passes gives
    # it whole (_one_graph_forward); a long prompt stays eager
    static = (drafter.compiled and min(past) > 0 and static_slots(indices, drafter.aot)) or _one_graph_forward(passes)
    if not static and alone is not None and past[0] == 0 and alone.block is None:
        mask = CAUSAL  # a first pass over a prompt: SDPA's own causal mask, no [T, T] tensor
    elif not static and alone is not None and width == 1 and (alone.block is None or bool(alone.block.all())):
        mask = None  # one query that sees every key the cache returns (a chain step): no mask at all
    else:
        allowed = padded_allowed([p.allowed_block() for p in passes], past, width, kv_len)
        mask = additive_mask(allowed.to(device), dtype)[:, None]
    cache = ForwardCache(kv, indices, past, width, kv_len, static_mask=mask if static else None)
    # outputs only where someone reads them: a context pass's last row, every row of a draft pass
    if alone is not None:  # one range, no concatenation: this runs for every pass
        rows = torch.arange(alone.size - 1 if alone.is_context else 0, alone.size, device=device)
    else:
        rows = torch.cat([torch.tensor([b * width + p.size - 1]) if p.is_context else torch.arange(p.size) + b * width
                          for b, p in enumerate(passes)]).to(device)
    logits, fed, h_rows = drafter.forward_rows(ids, x, pos, cache, mask, rows)
    norms = state_norms(h_rows)
    counts = [1 if p.is_context else p.size for p in passes]
    for p in passes:
        if p.is_context:
            p.cache.commit(p.past, list(range(p.size)))
    return [PassOutput(*out) for out in zip(logits.split(counts), fed.split(counts), norms.split(counts))]
