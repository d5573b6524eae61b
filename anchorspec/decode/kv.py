"""Committing the accepted path into the target's KV cache.

Verification appends all N tree entries after the committed prefix. Only the accepted root-to-node
path survives: its rows move to contiguous positions right after the prefix (their RoPE positions
were already prefix + depth, i.e. exactly those slots), and everything after is dropped.

`commit_path` does it for a DynamicCache (the prefill's); `StaticKV` is the preallocated cache a
sequence decodes on when it steps alone, written in place, with its own `commit`.
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


class StaticKV:
    """One sequence's target KV cache, preallocated: per decoder layer one key and one value buffer
    [1, kv_heads, capacity, head_dim]. A forward writes its n new rows in place right after the
    `length` committed rows and attends to a view of the buffer (DynamicCache concatenates the whole
    cache on every step instead); `commit` keeps the accepted ones. Capacity doubles when needed.

    Transformers sees it through `update`, and, for a forward without a mask (one new token: the
    causal default, which SDPA then runs with no mask tensor at all), through the two sizes its
    mask code asks for. A tree verification passes its 4-D mask, and the model asks nothing else."""

    def __init__(self, cache, capacity: int):
        """From a prefilled DynamicCache of full-attention layers (`filled_full_attention`)."""
        first = cache.layers[0].keys
        self.length = first.shape[2]
        self.keys, self.values = [], []
        for layer in cache.layers:
            for bufs, rows in ((self.keys, layer.keys), (self.values, layer.values)):
                buf = rows.new_zeros(1, rows.shape[1], max(capacity, self.length), rows.shape[3])
                buf[:, :, :self.length] = rows
                bufs.append(buf)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def get_query_offset(self, layer_idx: int = 0) -> int:  # transformers' mask code: queries start here
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # keys seen, first key
        return self.length + query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # HF Cache.update's signature (5.x passes kwargs=)
        """Write the new rows at [length, length + n) of layer `layer_idx`; return its rows [0, length + n)."""
        end = self.length + key_states.shape[2]
        if end > self.capacity:
            self._grow(end)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        n = end - self.length
        keys.narrow(2, self.length, n).copy_(key_states)  # narrow + copy_: no Python indexing per layer
        values.narrow(2, self.length, n).copy_(value_states)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def _grow(self, rows: int) -> None:
        capacity = self.capacity
        while capacity < rows:
            capacity *= 2
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                bufs[i] = old.new_zeros(1, old.shape[1], capacity, old.shape[3])
                bufs[i][:, :, :old.shape[2]] = old  # the rows of layers already written this forward too

    @torch.inference_mode()
    def commit(self, start: int, keep: list[int]) -> None:
        """The cache holds `start` committed rows plus new ones; keep new rows `keep`, in order."""
        if start != self.length:
            raise AnchorspecError(f"commit at row {start}, but the cache holds {self.length} committed rows")
        n = len(keep)
        if keep != list(range(n)):  # a prefix of the new rows (chains, plain steps) is already in place
            src = torch.tensor(keep, dtype=torch.long, device=self.keys[0].device) + start
            for buf in self.keys + self.values:
                # index_select copies first, so overlapping source and destination rows are safe
                buf[:, :, start:start + n] = buf.index_select(2, src)
        self.length = start + n


def filled_full_attention(cache) -> bool:
    """Whether `cache` is a filled DynamicCache of full-attention layers only."""
    from transformers.cache_utils import DynamicLayer

    layers = list(getattr(cache, "layers", []))
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)
