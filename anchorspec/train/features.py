"""Target features for training: online (the target runs in the training loop) or an offline cache.

The cache stores, per token, what the TTT loss needs and nothing that depends on the draft
vocabulary, so one cache serves every drafter trained on the same data and target (EAGLE-3 and
EAGLE-3.1 runs share it):

* ``aux``    [T, n_aux*H]  the captured aux hidden states (the drafter's input),
* ``hidden`` [T, H]        the target's final hidden state (the LM head's input): the soft target
                            over any draft vocabulary is recomputed as hidden @ W[draft ids]^T,
                            a sixth of the full head for a 8k draft vocabulary, instead of storing V logits,
* ``argmax`` [T]           the target's own next-token choice over the full vocabulary (whether it
                            is representable in the draft vocabulary decides if a position counts).

Layout: ragged examples as flat tensors plus offsets, in safetensors shards of about
``shard_tokens`` tokens, each named by the fingerprint of its examples. ``index.json`` lists the
finished shards and the layout of the current data, and is rewritten atomically after each shard,
so a killed build resumes at the first missing shard and a grown corpus reuses the shards it still holds.
Reading maps the shards instead of loading them (4.6 KB per token in bf16: a corpus of 8M tokens is a
38 GB cache, more than a small machine's memory).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from anchorspec.errors import AnchorspecError

from ..atomic import atomic_write
from ..models.dtype import argmax_last
from ..models.target import Target
from .dataset import Example, collate, epoch_batches

FORMAT = 2  # 2: shards keyed by the fingerprint of their examples (a growing corpus reuses them)


@dataclass
class Features:
    """A right-padded batch of target features."""
    aux: torch.Tensor  # [B, T, n_aux*H]
    hidden: torch.Tensor  # [B, T, H] final hidden state
    argmax: torch.Tensor  # [B, T] int64


def target_head(target: Target) -> torch.nn.Module:
    return target.model.get_output_embeddings()


@torch.no_grad()
def compute_features(target: Target, input_ids: torch.Tensor, padding_mask: torch.Tensor,
                     check_head: bool = False) -> Features:
    """Run the target once; capture aux states and the LM head's input. With ``check_head``, verify
    that the head alone maps that input to the model's logits (a model that rescales logits outside
    its head, e.g. Granite, cannot use the cache)."""
    head = target_head(target)
    seen = {}

    def grab(_module, args):
        seen["h"] = args[0]

    handle = head.register_forward_pre_hook(grab)
    try:
        out = target.features(input_ids, padding_mask)
    finally:
        handle.remove()
    hidden = seen["h"]
    if check_head:
        again = head(hidden)
        if not torch.allclose(again.float(), out.logits.float(), atol=1e-3, rtol=1e-3):
            raise AnchorspecError("this target transforms its logits outside the LM head (e.g. logit scaling); "
                                  "the offline feature cache cannot rebuild them: train with online features")
    return Features(aux=out.aux, hidden=hidden, argmax=argmax_last(out.logits))


def fingerprint(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(len(e.input_ids).to_bytes(4, "little"))
        h.update(torch.tensor(e.input_ids, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def _shard_ranges(examples: list[Example], shard_tokens: int) -> list[tuple[int, int]]:
    ranges, start, tokens = [], 0, 0
    for i, e in enumerate(examples):
        tokens += len(e.input_ids)
        if tokens >= shard_tokens:
            ranges.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(examples):
        ranges.append((start, len(examples)))
    return ranges


def _read_index(index_path: Path, meta: dict, cache_dir) -> dict:
    """The index to build on: the old one when it was made for this target, else an empty one."""
    index = {**meta, "shards": {}}
    if index_path.is_file():
        old = json.loads(index_path.read_text())
        if old.get("format") != FORMAT:  # an older layout: nothing in it can be reused
            return index
        diff = [k for k in meta if old.get(k) != meta[k]]
        if diff:
            raise AnchorspecError(f"feature cache {cache_dir} was built for another target or dtype "
                                  f"({', '.join(diff)} differ); use another directory")
        index["shards"] = old["shards"]
    return index


def build_feature_cache(target: Target, examples: list[Example], cache_dir, batch_tokens: int = 4096,
                        shard_tokens: int = 1 << 18, progress: bool = True) -> dict:
    """Write (or finish writing) the cache for ``examples``; returns the index (with its size in bytes).

    Shards are keyed by the fingerprint of the examples they hold, and shard boundaries depend only
    on the examples before them, so a corpus that grows by appending parts reuses every full shard
    and recomputes only the old tail and the new examples; a killed build resumes at the first
    missing shard."""
    from safetensors.torch import save_file
    from ..progress import progress_bar

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "aux_layer_ids": list(target.aux_layer_ids),
            "dtype": str(target.dtype).removeprefix("torch."),
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}
    index_path = cache_dir / "index.json"
    index = _read_index(index_path, meta, cache_dir)
    shards: dict = index["shards"]
    ranges = _shard_ranges(examples, shard_tokens)
    layout = [fingerprint(examples[a:b]) for a, b in ranges]
    index.update(fingerprint=fingerprint(examples), num_examples=len(examples), layout=layout)
    have = {fp for fp in layout if fp in shards and (cache_dir / shards[fp]["file"]).is_file()}
    total = sum(len(e.input_ids) for e in examples)
    bar = progress_bar(total=total, initial=sum(shards[fp]["tokens"] for fp in have), desc="feature cache", unit="tok",
                       disable=not progress, unit_scale=True)

    def write_index():
        atomic_write(index_path, lambda f: Path(f).write_text(json.dumps(index, indent=1) + "\n"))

    checked = False
    for (a, b), fp in zip(ranges, layout):
        if fp in have:
            continue
        part = examples[a:b]
        lengths = [len(e.input_ids) for e in part]
        rows: dict[int, tuple] = {}
        for idx in epoch_batches(lengths, batch_tokens, seed=0, epoch=0):
            ids, _, pm = collate([part[i] for i in idx])
            f = compute_features(target, ids, pm, check_head=not checked)
            checked = True
            for r, i in enumerate(idx):
                L = lengths[i]
                rows[i] = (f.aux[r, :L].clone(), f.hidden[r, :L].clone(), f.argmax[r, :L].to(torch.int32))
            bar.update(int(pm.sum()))
        order = range(len(part))
        tensors = {"aux": torch.cat([rows[i][0] for i in order]), "hidden": torch.cat([rows[i][1] for i in order]),
                   "argmax": torch.cat([rows[i][2] for i in order]),
                   "offsets": torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)}
        name = f"shard-{fp}.safetensors"
        atomic_write(cache_dir / name, lambda f: save_file(tensors, f))
        shards[fp] = {"file": name, "count": b - a, "tokens": sum(lengths), "bytes": (cache_dir / name).stat().st_size}
        have.add(fp)
        write_index()
    bar.close()
    stale = [fp for fp in shards if fp not in set(layout)]  # shards of examples no longer in the data
    for fp in stale:
        shards.pop(fp)
    write_index()
    for fp in stale:
        name = f"shard-{fp}.safetensors"
        if name not in {s["file"] for s in shards.values()}:
            (cache_dir / name).unlink(missing_ok=True)
    return {**index, "shards": [{"first": a, "fingerprint": fp, **shards[fp]} for (a, _), fp in zip(ranges, layout)],
            "bytes": sum(shards[fp]["bytes"] for fp in layout), "tokens": total}


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def map_safetensors(path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a private (copy-on-write) mapping of it: pages are read
    when a row is used and the kernel may drop them again, where `load_file` copies the whole file into memory."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable, so torch.frombuffer does not warn
    size = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8:8 + size])
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES[spec["dtype"]]
        start, end = spec["data_offsets"]
        count = (end - start) // dtype.itemsize
        flat = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + size + start) if count
                else torch.empty(0, dtype=dtype))  # the tensor keeps the mapping alive
        out[name] = flat.reshape(spec["shape"])
    return out


class FeatureCache:
    """Read side: example i -> (aux, hidden, argmax), from memory-mapped shards."""

    def __init__(self, cache_dir, examples: list[Example] | None = None):
        cache_dir = Path(cache_dir)
        index_path = cache_dir / "index.json"
        if not index_path.is_file():
            raise AnchorspecError(f"no feature cache in {cache_dir} (index.json missing)")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise AnchorspecError(f"feature cache {cache_dir} has format {self.index.get('format')}, expected {FORMAT}; "
                                  f"rebuild it (train builds it on first use)")
        if examples is not None and self.index["fingerprint"] != fingerprint(examples):
            raise AnchorspecError(f"feature cache {cache_dir} was built from other examples; rebuild it")
        shards = self.index["shards"]
        ready = [fp for fp in self.index["layout"] if fp in shards and (cache_dir / shards[fp]["file"]).is_file()]
        if len(ready) != len(self.index["layout"]):
            covered = sum(shards[fp]["count"] for fp in ready)
            raise AnchorspecError(f"feature cache {cache_dir} is incomplete ({covered}/{self.index['num_examples']} "
                                  f"examples); finish building it first")
        self._rows: list[tuple[int, int, int]] = []  # (shard, start, end) per example
        self._shards = []
        for k, fp in enumerate(self.index["layout"]):
            t = map_safetensors(cache_dir / shards[fp]["file"])
            self._shards.append(t)
            off = t["offsets"].tolist()
            self._rows += [(k, off[j], off[j + 1]) for j in range(shards[fp]["count"])]

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, a, b = self._rows[i]
        t = self._shards[k]
        return t["aux"][a:b], t["hidden"][a:b], t["argmax"][a:b]

    def batch(self, indices: list[int]) -> Features:
        """Right-padded features of the given examples (zeros past each row's end)."""
        parts = [self.get(i) for i in indices]
        T = max(p[0].shape[0] for p in parts)
        B = len(parts)
        aux = parts[0][0].new_zeros(B, T, parts[0][0].shape[1])
        hidden = parts[0][1].new_zeros(B, T, parts[0][1].shape[1])
        argmax = torch.zeros(B, T, dtype=torch.long)
        for r, (a, h, m) in enumerate(parts):
            n = a.shape[0]
            aux[r, :n], hidden[r, :n], argmax[r, :n] = a, h, m.long()
        return Features(aux, hidden, argmax)


def draft_logits(hidden: torch.Tensor, head_weight: torch.Tensor, draft_to_target: torch.Tensor,
                 head_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits restricted to the draft vocabulary, in draft-id order: Z[..., draft_to_target]."""
    w = head_weight[draft_to_target]
    out = hidden.to(w.dtype) @ w.T
    return out + head_bias[draft_to_target] if head_bias is not None else out
