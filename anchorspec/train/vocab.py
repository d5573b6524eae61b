"""Draft vocabulary selection and the d2t/t2d mapping (eagle31-spec.md §4).

Counts token frequencies over the loss-masked (assistant) positions of the training data, takes the
``draft_vocab_size`` most frequent ids (ties -> lower id; forced ids such as EOS displace the least frequent;
padding with the lowest unused ids when too few tokens occur, as TorchSpec does), and builds
``d2t[i] = used[i] - i`` (int64 offsets) and ``t2d`` (bool mask over the target vocabulary), exactly as
``Eagle3Drafter.set_vocab_mapping`` does. All functions are pure and deterministic.
"""

from __future__ import annotations

from typing import Iterable

import torch

from anchorspec.errors import AnchorspecError
from anchorspec.models.vocab_map import int_tensor, vocab_mapping  # noqa: F401 (vocab_mapping: re-exported)

__all__ = ["count_loss_tokens", "select_draft_vocab", "vocab_mapping", "coverage", "remap_head_rows", "head_map"]


COUNT_CHUNK = 1 << 20  # kept ids per bincount


def count_loss_tokens(batches: Iterable, vocab_size: int) -> torch.Tensor:
    """Frequency of each token id over positions with loss_mask == 1; int64 tensor of length vocab_size.

    ``batches`` yields (input_ids, loss_mask) pairs: lists or 1-D/2-D tensors of equal shape, masks of 0/1.
    """
    if int(vocab_size) < 1:
        raise AnchorspecError(f"vocab_size={vocab_size} must be >= 1")
    vocab_size = int(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    # one bincount per ~1M kept ids, not one per batch: a bincount of minlength V per conversation summed 95k
    # vectors of 49,152 for a 28M-token corpus (~50 s of a training run's start, session 88)
    kept: list[torch.Tensor] = []
    pending = 0
    for n, pair in enumerate(batches):
        try:
            input_ids, loss_mask = pair
        except (TypeError, ValueError):
            raise AnchorspecError(f"batch {n}: expected an (input_ids, loss_mask) pair, got {type(pair).__name__}") from None
        ids = int_tensor(input_ids, f"batch {n}: input_ids")
        mask = torch.as_tensor(loss_mask)
        if ids.dim() not in (1, 2):
            raise AnchorspecError(f"batch {n}: input_ids must be 1-D or 2-D, got shape {tuple(ids.shape)}")
        if tuple(mask.shape) != tuple(ids.shape):
            raise AnchorspecError(f"batch {n}: loss_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            continue
        bad_mask = ~((mask == 0) | (mask == 1))
        if bool(bad_mask.any()):
            raise AnchorspecError(f"batch {n}: loss_mask must be 0/1, found value {mask[bad_mask].flatten()[0].item()}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise AnchorspecError(f"batch {n}: token id {bad} outside the vocabulary 0..{vocab_size - 1}")
        kept.append(ids[mask == 1])
        pending += kept[-1].numel()
        if pending >= COUNT_CHUNK:
            counts += torch.bincount(torch.cat(kept), minlength=vocab_size)
            kept, pending = [], 0
    if kept:
        counts += torch.bincount(torch.cat(kept), minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, always_include=()) -> torch.Tensor:
    """The draft_vocab_size most frequent target ids, sorted ascending (int64).

    Ties go to the lower id; ids in ``always_include`` (e.g. EOS / end-of-turn) are forced in, displacing the
    least frequent; if fewer ids have nonzero counts than needed, the lowest unused ids fill the rest.
    """
    counts = torch.as_tensor(counts)
    if counts.dim() != 1 or counts.numel() == 0:
        raise AnchorspecError(f"counts must be a non-empty 1-D tensor, got shape {tuple(counts.shape)}")
    if counts.is_complex() or not bool((counts >= 0).all()):
        raise AnchorspecError("counts must be non-negative numbers")
    V = counts.numel()
    k = int(draft_vocab_size)
    if not 1 <= k <= V:
        raise AnchorspecError(f"draft_vocab_size={draft_vocab_size} must be in 1..vocab_size={V}")
    inc = always_include if isinstance(always_include, torch.Tensor) else list(always_include)
    forced = int_tensor(inc, "always_include").view(-1).unique()  # sorted, deduplicated
    if forced.numel() and (int(forced[0]) < 0 or int(forced[-1]) >= V):
        bad = int(forced[0]) if int(forced[0]) < 0 else int(forced[-1])
        raise AnchorspecError(f"always_include id {bad} outside the vocabulary 0..{V - 1}")
    if forced.numel() > k:
        raise AnchorspecError(f"always_include has {forced.numel()} ids, more than draft_vocab_size={k}")
    # Stable descending sort: equal counts keep ascending id order, zero-count ids come last in id order
    # (which is the "pad with the lowest unused ids" rule).
    order = torch.sort(counts, descending=True, stable=True).indices
    is_forced = torch.zeros(V, dtype=torch.bool)
    is_forced[forced] = True
    rest = order[~is_forced[order]][: k - forced.numel()]
    return torch.sort(torch.cat([forced, rest])).values


def coverage(counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """Share of loss-masked token occurrences whose id is in the draft vocabulary (an upper bound on acceptance)."""
    counts = torch.as_tensor(counts)
    if counts.dim() != 1 or counts.numel() == 0:
        raise AnchorspecError(f"counts must be a non-empty 1-D tensor, got shape {tuple(counts.shape)}")
    if counts.is_complex() or not bool((counts >= 0).all()):
        raise AnchorspecError("counts must be non-negative numbers")
    ids = int_tensor(draft_ids, "draft_ids").view(-1)
    if ids.unique().numel() != ids.numel():
        raise AnchorspecError(f"draft_ids must be unique, got {ids.numel()} ids with {ids.unique().numel()} distinct")
    V = counts.numel()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise AnchorspecError(f"draft id {bad} outside the vocabulary 0..{V - 1}")
    c = counts.to(torch.float64)
    total = float(c.sum())
    if total == 0:
        raise AnchorspecError("coverage is undefined: no loss-masked tokens were counted (all loss_mask == 0?)")
    return float(c[ids].sum()) / total


def head_map(old_ids: torch.Tensor, old_rows: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor | None:
    """The linear map A (least squares, [H_target, H]) that best turns the target's head rows into a
    trained drafter's: old_rows ~ target_head[old_ids] @ A. A new token's row then starts at
    target_head[id] @ A, in the drafter's own scale and directions; the target's rows as they are sit
    ~1.4x larger than a trained drafter's, so new tokens stole the argmax (SmolLM2 round 11: row
    cosine 0.62 against 0.84 for the map on held-out rows, and adding 8,192 rows that way cut the
    held-out first-step accuracy from 0.74 to 0.44). None when fewer than 2 x H rows pin it down."""
    x = target_head[old_ids.view(-1).long()].double()
    if x.shape[0] < 2 * x.shape[1]:
        return None
    return torch.linalg.lstsq(x, old_rows.detach().double()).solution


def remap_head_rows(old_ids: torch.Tensor, old_rows: torch.Tensor, new_ids: torch.Tensor,
                    fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Head rows for a new draft vocabulary: the old row of every target id the old vocabulary
    had, ``fallback[target id]`` (e.g. the target's own head mapped by `head_map`) for the others. Ids
    are target ids in draft-row order. Returns (rows [len(new_ids), H], how many rows were kept)."""
    old_ids, new_ids = old_ids.view(-1).long(), new_ids.view(-1).long()
    if old_rows.shape[0] != old_ids.numel() or old_rows.shape[1] != fallback.shape[1]:
        raise AnchorspecError(f"head rows {tuple(old_rows.shape)} do not match {old_ids.numel()} draft ids and a "
                              f"fallback of width {fallback.shape[1]}")
    where = torch.full((fallback.shape[0],), -1, dtype=torch.long)
    where[old_ids] = torch.arange(old_ids.numel())
    src = where[new_ids]
    kept = src >= 0
    rows = fallback[new_ids].to(device=old_rows.device, dtype=old_rows.dtype).clone()
    rows[kept] = old_rows[src[kept]]
    return rows, int(kept.sum())
