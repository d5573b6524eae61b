"""The d2t/t2d convention of EAGLE-3 checkpoints (a leaf module: the drafter, training and export
all use this one definition). d2t stores offsets: target id = draft id + d2t[draft id]; t2d marks
the target ids that have a draft id."""

from __future__ import annotations

import torch

from ..errors import AnchorspecError


def int_tensor(x, what: str) -> torch.Tensor:
    """`x` as int64, refusing floats (token ids)."""
    t = torch.as_tensor(x)
    if t.numel() == 0:
        return t.to(torch.long)
    if t.is_floating_point() or t.is_complex():
        raise AnchorspecError(f"{what} must hold integers, got dtype {t.dtype}")
    return t.to(torch.long)


def vocab_mapping(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary: d2t[i] = used[i] - i (int64), t2d[v] = v in used (bool, len vocab_size)."""
    V = int(vocab_size)
    used = int_tensor(draft_ids, "draft_ids")
    if used.dim() != 1 or used.numel() == 0:
        raise AnchorspecError(f"draft_ids must be a non-empty 1-D tensor, got shape {tuple(used.shape)}")
    used = torch.sort(used).values
    if used.unique().numel() != used.numel():
        raise AnchorspecError(f"draft_ids must be unique, got {used.numel()} ids with {used.unique().numel()} distinct")
    if int(used[0]) < 0 or int(used[-1]) >= V:
        bad = int(used[0]) if int(used[0]) < 0 else int(used[-1])
        raise AnchorspecError(f"draft id {bad} outside the vocabulary 0..{V - 1}")
    d2t = used - torch.arange(used.numel(), dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d
