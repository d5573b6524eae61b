"""Committing the accepted path into the target's KV cache.

Verification appends all N tree entries after the committed prefix. Only the accepted root-to-node
path survives: its rows move to contiguous positions right after the prefix (their RoPE positions
were already prefix + depth, i.e. exactly those slots), and everything after is dropped.
"""

from __future__ import annotations

import torch

from ..errors import AnchorspecError


@torch.inference_mode()  # the cache rows are inference tensors; in-place edits must happen in this mode
def commit_path(cache, start: int, keep: list[int]) -> None:
    """`cache` holds `start` committed rows plus the tree rows; keep tree rows `keep` (in order)."""
    from transformers.cache_utils import DynamicLayer

    n = len(keep)
    contiguous = keep == list(range(n))  # always true for chains: a plain truncation
    idx = None if contiguous else torch.tensor(keep, dtype=torch.long) + start
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise AnchorspecError(
                f"KV commit supports full-attention caches only, got {type(layer).__name__} (sliding-window models)"
            )
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        if idx is not None:
            # index_select copies first, so overlapping source and destination rows are safe
            layer.keys[:, :, start:start + n] = layer.keys.index_select(2, idx)
            layer.values[:, :, start:start + n] = layer.values.index_select(2, idx)
        layer.keys = layer.keys[:, :, :start + n]
        layer.values = layer.values[:, :, :start + n]
