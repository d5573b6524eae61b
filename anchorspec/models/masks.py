"""Attention masks as the models take them: boolean "may attend" -> additive (0 or the dtype's most
negative value). A leaf module: decode, train and the drafter all build their masks here."""

from __future__ import annotations

import torch

CAUSAL = "causal"  # `mask` value for a pass with an empty cache: SDPA applies the causal mask itself


def causal_mask(T: int, past: int, dtype, device) -> torch.Tensor:
    allowed = torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)
    return additive_mask(allowed, dtype)[None, None]


def additive_mask(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """Boolean 'may attend' -> additive mask (0 or the dtype's most negative value)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
