"""One target forward for several sequences: a slot-based KV cache, the padded inputs, the commit.

KV layout (static-cache style, as gpt-fast keeps it): per decoder layer one key and one value
tensor [slots, kv_heads, capacity, head_dim]. Slot s holds its sequence's committed rows at
[0, length_s). A forward writes row b's j-th new token at length_b + j, so each sequence's new rows
sit right after its own prefix whatever the other lengths are; RoPE positions come from
position_ids, never from the physical index. Rows at or past a slot's length are scratch: masked
out, overwritten later. Capacity and slot count grow geometrically (doubling) when needed.

One forward for B sequences with n_b new tokens each (a draft tree; a plain step is a 1-node tree),
padded to N = max n_b:
  - position_ids[b, j] = length_b + depth_b(j)
  - additive mask [B, 1, N, K], K = max_b length_b + N: query j of row b sees keys [0, length_b)
    and the new keys of its tree ancestors (length_b + ancestor), i.e. exactly its solo tree mask;
    padding queries see only themselves (finite outputs that nobody reads).
Commit, per slot: move the accepted path's rows to length_b .. length_b + len(path) - 1 (their
RoPE positions were already length_b + depth, i.e. exactly those rows); the rest become scratch.

Live slots stay dense (indices 0..n-1; releasing one moves the last into its place), so a forward
over all live sequences (or any run of consecutive slots) reads views of the buffers, never copies.

A solo generation is a batch of one on a one-slot BatchKV of its own (decode/engine.py), its prefill
included: one row whose tree is a chain (a prompt, a plain step, a drafted chain) needs no mask
tensor, so the model builds its own causal mask from the sizes the cache reports (or none at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import AnchorspecError
from ..models.compiled import GRAPH_PREFILL_TOKENS, graphs_compiled, write_and_read
from ..models.masks import additive_mask
from ..models.target import Target
from .tree import DraftTree


_reallocations = 0  # BatchKV buffers reallocated (grown) in this process: see one_offs


def one_offs() -> tuple[int, int]:
    """What this process has paid once and will not pay again at the same size: graphs compiled or loaded, KV buffers
    grown. A step or round during which either count moved is no sample of what it costs: a compile takes tens of
    seconds, and growing 16 slots' cache from 512 to 1,024 rows zero-fills 377 MB (a 0.7-1.3 s round against ~50 ms;
    AMX Xeon, bf16, 1 thread, session 82), which as a sample priced a 16-row plain round at twice its cost for the next
    twenty rounds."""
    return graphs_compiled(), _reallocations


class KVSlot:
    """One sequence's rows in a BatchKV. `length` = committed rows; `index` = None once released."""

    def __init__(self, kv: "BatchKV", index: int, length: int):
        self.kv, self.index, self.length = kv, index, length

    @property
    def released(self) -> bool:
        return self.index is None

    def commit(self, start: int, keep: list[int]) -> None:
        self.kv.commit(self, start, keep)

    def release(self) -> None:
        self.kv.release(self)

    def crop(self, length: int) -> None:
        """Roll back to `length` committed rows (rows past it become scratch)."""
        if not 0 <= length <= self.length:
            raise AnchorspecError(f"crop to {length} rows, but the slot holds {self.length}")
        self.length = length


def _grown(size: int, needed: int) -> int:
    size = max(size, 1)
    while size < needed:
        size *= 2
    return size


class BatchKV:
    """Padded per-layer K/V buffers for up to `len(self.slots)` sequences (see the module docstring)."""

    def __init__(self, slots: int = 4, capacity: int = 256):
        if slots < 1 or capacity < 1:
            raise AnchorspecError(f"BatchKV needs slots >= 1 and capacity >= 1, got {slots}, {capacity}")
        self._min_slots, self._min_capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: list[KVSlot] = []  # live slots; slots[i].index == i

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @torch.inference_mode()
    def attach_target(self, target: Target) -> KVSlot:
        """A new empty slot for a sequence of `target`: its prefill writes straight into it."""
        c = target.config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return self.attach_empty(target.num_layers, kv_heads, head_dim, target.dtype, target.embed_weight.device)

    @torch.inference_mode()
    def attach_empty(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> KVSlot:
        """A new slot with no rows yet, for a model of `num_layers` layers of these key/value shapes."""
        empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=dtype, device=device)
        return self.attach_rows([empty] * num_layers, [empty] * num_layers)

    @torch.inference_mode()
    def attach_rows(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> KVSlot:
        """Copy per-layer keys and values [1, kv_heads, length, head_dim] (length may be 0) into a new slot."""
        length = keys[0].shape[2]
        if not self.keys:
            self.keys = [self._empty(k, self._min_slots, max(self._min_capacity, length)) for k in keys]
            self.values = [self._empty(v, self._min_slots, self.capacity) for v in values]
        else:
            self._check_rows(keys)
        self.reserve(len(self.slots) + 1, length)
        slot = KVSlot(self, len(self.slots), 0)
        self.slots.append(slot)
        self.extend(slot, keys, values)
        return slot

    @torch.inference_mode()
    def extend(self, slot: KVSlot, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Append committed rows (per layer [1, kv_heads, n, head_dim], e.g. a shared prompt prefix's)
        after the slot's own."""
        self.check(slot)
        self._check_rows(keys)
        start, n = slot.length, keys[0].shape[2]
        self.reserve(len(self.slots), start + n)
        for bufs, rows in ((self.keys, keys), (self.values, values)):
            for buf, new in zip(bufs, rows):
                buf[slot.index, :, start:start + n] = new[0]
        slot.length = start + n

    def _check_rows(self, keys: list[torch.Tensor]) -> None:
        if (len(keys) != len(self.keys) or keys[0].shape[1::2] != self.keys[0].shape[1::2]
                or keys[0].dtype != self.keys[0].dtype):
            raise AnchorspecError("BatchKV: these rows do not have the shape of the ones already attached")

    @staticmethod
    def _empty(like: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
        # zeros, not empty(): masked keys are multiplied by 0 weights, and 0 * NaN would be NaN
        return torch.zeros(slots, like.shape[1], capacity, like.shape[3], dtype=like.dtype, device=like.device)

    @torch.inference_mode()
    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for `slots` sequences of `capacity` rows (doubling, so growth is amortised)."""
        if not self.keys:
            raise AnchorspecError("BatchKV.reserve before any attach: the buffer shapes come from the first cache")
        new_slots, new_cap = _grown(self.num_slots, slots), _grown(self.capacity, capacity)
        if (new_slots, new_cap) == (self.num_slots, self.capacity):
            return
        global _reallocations
        _reallocations += 1
        live = len(self.slots)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = self._empty(old, new_slots, new_cap)
                new[:live, :, :old.shape[2]] = old[:live]  # scratch rows too: a commit may still be pending
                bufs[i] = new

    @torch.inference_mode()
    def release(self, slot: KVSlot) -> None:
        """Free a slot; the last live slot moves into its place, so live slots stay 0..n-1."""
        self.check(slot)
        last = self.slots.pop()
        if last is not slot:
            for buf in self.keys + self.values:
                buf[slot.index] = buf[last.index]  # scratch rows too: its commit may still be pending
            last.index = slot.index
            self.slots[slot.index] = last
        slot.index = None
        if not self.slots:  # drop the buffers: a long request's capacity is not kept forever
            self.keys, self.values = [], []

    @torch.inference_mode()
    def commit(self, slot: KVSlot, start: int, keep: list[int]) -> None:
        """The slot holds `start` committed rows plus new rows; keep new rows `keep`, in order."""
        self.check(slot)
        if start != slot.length:
            raise AnchorspecError(f"commit at row {start}, but the slot holds {slot.length} committed rows")
        n = len(keep)
        if start + (max(keep) + 1 if keep else 0) > self.capacity:
            raise AnchorspecError(f"commit of rows {keep} past the slot's capacity {self.capacity}")
        if keep != list(range(n)):  # a prefix of the new rows (chains, plain steps) is already in place
            src = torch.tensor(keep, dtype=torch.long, device=self.keys[0].device) + start
            for buf in self.keys + self.values:
                row = buf[slot.index]
                # index_select copies first, so overlapping source and destination rows are safe
                row[:, start:start + n] = row.index_select(1, src)
        slot.length = start + n

    def check(self, slot: KVSlot) -> None:
        """Refuse a slot that was released or belongs to another BatchKV."""
        if slot.kv is not self or slot.released or self.slots[slot.index] is not slot:
            raise AnchorspecError("this KV slot was released or belongs to another BatchKV")


# --- one padded forward ---------------------------------------------------------------------------

def slot_order(indices: list[int]) -> list[int] | None:
    """The row order that sorts these slot indices, or None if they are sorted already. A forward
    whose rows are a run of consecutive slots in order reads each layer's cache through a view; in
    any other order it gathers (copies) every row of every layer, which cost 6 % of batched
    regeneration's throughput once releases had shuffled the slots (bf16, batch 32)."""
    order = sorted(range(len(indices)), key=indices.__getitem__)
    return None if order == list(range(len(indices))) else order


def inverse(order: list[int]) -> list[int]:
    """back[b] = where row b went: results of a forward run in `order` are read back as [back[b]]."""
    back = [0] * len(order)
    for k, b in enumerate(order):
        back[b] = k
    return back


def batch_position_ids(trees: list[DraftTree], past_lens: list[int], width: int) -> torch.Tensor:
    """[B, width]: past_len + depth per node; padding at the row's past_len (never attended)."""
    pos = torch.tensor(past_lens, dtype=torch.long)[:, None].repeat(1, width)
    for b, tree in enumerate(trees):
        pos[b, :tree.size] += torch.tensor(tree.depths, dtype=torch.long)
    return pos


def padded_allowed(blocks: list[torch.Tensor], past_lens: list[int], width: int, kv_len: int) -> torch.Tensor:
    """[B, width, kv_len] bool from per-row blocks: blocks[b] is [n_b, w_b] over the row's last w_b
    keys (its newest past rows and its n_b new ones); every earlier key is visible to all its real
    queries. Padding queries see only themselves (finite outputs that nobody reads)."""
    allowed = torch.zeros(len(blocks), width, kv_len, dtype=torch.bool)
    for b, (block, past) in enumerate(zip(blocks, past_lens)):
        n, w = block.shape
        end = past + n
        allowed[b, :n, :end - w] = True
        allowed[b, :n, end - w:end] = block
        pad = torch.arange(n, width)
        allowed[b, pad, past + pad] = True
    return allowed


def batch_allowed(trees: list[DraftTree], past_lens: list[int], width: int, kv_len: int) -> torch.Tensor:
    """[B, width, kv_len] bool: row b's query j may attend key k (see the module docstring)."""
    return padded_allowed([tree.ancestors() for tree in trees], past_lens, width, kv_len)


def static_slots(indices: list[int], one_slot: bool) -> bool:
    """Whether a static ForwardCache takes a forward over these slots: 0..B-1, or with `one_slot` (an AOT graph, which
    reads a view of that slot's rows; torch.compile would guard on the view's offset) any single slot."""
    return indices == list(range(len(indices))) or (one_slot and len(indices) == 1)


class ForwardCache:
    """The cache a model sees in one batched forward: HF's `past_key_values` (`update`) or the
    drafter's (`append`, one layer). Writes row b's new keys/values at its slot's rows past_b + j
    (past_b: the slot's length, plus any speculative rows an earlier drafter level wrote) and
    returns rows [0, kv_len) of every slot.

    `static_mask` (the forward's additive mask, for a compiled target): slots 0..B-1, or one slot (the graph then
    sees that slot's rows of every buffer as a one-slot cache: `buffers`), writes through index tensors and the key
    length read from the mask's last dimension, so no Python int changes from step to step and one compiled graph
    serves every step of a shape."""

    def __init__(self, kv: BatchKV, indices: list[int], past_lens: list[int], width: int, kv_len: int,
                 static_mask: torch.Tensor | None = None):
        self.kv, self.kv_len, self.batch = kv, kv_len, len(indices)
        self.first, self.past = indices[0], past_lens[0]
        self.consecutive = indices == list(range(self.first, self.first + len(indices)))  # views, no gather
        self.static_mask = static_mask
        if static_mask is not None and not (self.consecutive and self.first == 0 or self.batch == 1):
            raise AnchorspecError("a static ForwardCache needs slots 0..B-1 or one slot")
        self.base = self.first if static_mask is not None else 0  # slot b is row b - base of `buffers`
        # room for the new rows; a static forward gets a spare row: dynamo guards on whether its key slice
        # is the whole buffer (then contiguous), so a step that filled the buffer exactly compiled a graph
        # of its own mid-generation
        kv.reserve(len(kv.slots), kv_len + (static_mask is not None))
        if len(indices) > 1 or static_mask is not None:
            device = kv.keys[0].device
            self.index = torch.tensor(indices, dtype=torch.long, device=device)
            past = torch.tensor(past_lens, dtype=torch.long, device=device)
            self.rows, self.cols = self.index[:, None] - self.base, past[:, None] + torch.arange(width, device=device)

    @property
    def static(self) -> bool:  # Target.forward_rows runs a static forward through its compiled graph
        return self.static_mask is not None

    @property
    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The key and value buffers a static forward reads and writes: every slot's, or from slot `base` on (views:
        its writes land in the shared buffers)."""
        if not self.base:
            return self.kv.keys, self.kv.values
        return ([b.narrow(0, self.base, self.batch) for b in self.kv.keys],
                [b.narrow(0, self.base, self.batch) for b in self.kv.values])

    # transformers' mask code asks these when it builds the causal mask itself (one row, no mask given)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # keys seen, first key
        return self.kv_len, 0

    @property
    def length(self) -> int:  # the drafter reads it only to build a default mask; batched passes pass one
        raise AnchorspecError("a batched forward needs an explicit mask")

    def append(self, key_states, value_states):  # the drafter's cache interface (one layer)
        return self.update(key_states, value_states, 0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # HF Cache.update's signature (5.x passes kwargs=)
        out = []
        if self.static_mask is not None:  # slots 0..B-1 (of `buffers`) and the key length: the mask's (dynamic) dimensions
            keys, values = self.buffers
            return tuple(write_and_read(buf[layer_idx], new, self.rows, self.cols, self.static_mask)
                         for buf, new in ((keys, key_states), (values, value_states)))
        for buf, new in ((self.kv.keys[layer_idx], key_states), (self.kv.values[layer_idx], value_states)):
            if self.batch == 1:  # narrow + copy_: in place, no index tensors
                buf[self.first].narrow(1, self.past, new.shape[2]).copy_(new[0])
            else:
                buf[self.rows, :, self.cols] = new.transpose(1, 2).to(buf.dtype)  # [B, N, H, D] at (slot, row)
            rows = buf[:, :, :self.kv_len]  # cut to kv_len first: a gather then copies only these rows
            out.append(rows.narrow(0, self.first, self.batch) if self.consecutive else rows.index_select(0, self.index))
        return out[0], out[1]


@dataclass
class BatchOutput:
    logits: list[torch.Tensor]  # per sequence [n_b, V]
    aux: list[torch.Tensor] | None  # per sequence [n_b, n_aux * H]
    width: int  # padded new-token count N
    tokens: int  # real new tokens (sum of n_b)


@torch.inference_mode()
def batch_forward(target: Target, slots: list[KVSlot], trees: list[DraftTree], capture_aux: bool = True,
                  last_only: bool = False, positions_fn=batch_position_ids, allowed_fn=batch_allowed) -> BatchOutput:
    """One target forward over `trees[b]` appended to `slots[b]` (each slot's length = its past).

    Writes the new rows into the slots' scratch area; nothing is committed (call slot.commit).
    `last_only`: logits of each row's last node only (a prefill). `positions_fn` / `allowed_fn`
    exist so tests can inject a wrong mask and see it caught."""
    if not slots or len(slots) != len(trees):
        raise AnchorspecError(f"batch_forward needs one tree per slot, got {len(slots)} slots, {len(trees)} trees")
    kv = slots[0].kv
    for slot in slots:
        kv.check(slot)
    indices = [s.index for s in slots]
    if len(set(indices)) != len(indices):
        raise AnchorspecError("batch_forward: a slot appears twice in one batch")
    order = slot_order(indices)
    if order is not None:  # rows in slot order: the cache is then read through views, never gathered
        out = batch_forward(target, [slots[b] for b in order], [trees[b] for b in order], capture_aux, last_only,
                            positions_fn, allowed_fn)
        back = inverse(order)
        return BatchOutput([out.logits[k] for k in back], None if out.aux is None else [out.aux[k] for k in back],
                           out.width, out.tokens)
    past = [s.length for s in slots]
    width = max(t.size for t in trees)
    kv_len = max(past) + width
    device = kv.keys[0].device
    ids = torch.zeros(len(trees), width, dtype=torch.long)
    for b, tree in enumerate(trees):
        ids[b, :tree.size] = tree.tokens
        ids[b, tree.size:] = tree.tokens[0]  # any valid id: padding outputs are never read
    # a compiled target runs decode and verify steps as static forwards (slots 0..B-1), and an AOT-compiled one its
    # prefills of up to GRAPH_PREFILL_TOKENS too, in slots 0..B-1 or in one slot (a graph's mask has at least 2 keys)
    prefill_fits = target.aot and 2 <= width <= GRAPH_PREFILL_TOKENS
    static = target.compiled and (static_slots(indices, False) if not last_only
                                  else prefill_fits and static_slots(indices, True))
    if len(trees) == 1 and trees[0].is_chain and not static:
        mask = None  # plain causal attention: the model's own mask (SDPA may need none at all)
    else:
        mask = additive_mask(allowed_fn(trees, past, width, kv_len).to(device), target.dtype)[:, None]
    keep = torch.cat([torch.arange(t.size - 1 if last_only else 0, t.size) + b * width for b, t in enumerate(trees)])
    cache = ForwardCache(kv, indices, past, width, kv_len, static_mask=mask if static else None)
    out = target.forward_rows(ids.to(device), positions_fn(trees, past, width).to(device), cache, mask, keep,
                              capture_aux)
    sizes = [1 if last_only else t.size for t in trees]
    logits = list(out.logits.split(sizes))
    aux = [out.aux[b, :t.size] for b, t in enumerate(trees)] if capture_aux else None
    return BatchOutput(logits, aux, width, sum(t.size for t in trees))


@dataclass
class SharedPrefix:
    """A prompt prefix many requests share (a chat template's user-turn opening, a system prompt),
    with the target's keys and values for it, computed once: a request that starts with it copies
    these rows instead of running them (SpeculativeDecoding.start_from)."""
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [1, kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]

    @classmethod
    @torch.inference_mode()
    def build(cls, target: Target, tokens) -> "SharedPrefix":
        tokens = tuple(int(t) for t in tokens)
        n = len(tokens)
        if not n:
            raise AnchorspecError("a shared prefix needs at least one token")
        kv = BatchKV(slots=1, capacity=n)
        slot = kv.attach_target(target)
        batch_forward(target, [slot], [DraftTree.chain(torch.tensor(tokens))], capture_aux=False, last_only=True)
        slot.commit(0, list(range(n)))
        return cls(tokens, [k[:1, :, :n].clone() for k in kv.keys], [v[:1, :, :n].clone() for v in kv.values])
