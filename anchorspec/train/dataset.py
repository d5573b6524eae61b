"""Training examples: conversations -> (input_ids, loss_mask), a held-out split, and the batch order.

The order of micro-batches is a pure function of (seed, epoch): a resumed job replays exactly the
batches an uninterrupted one would have seen, and N data-parallel ranks split each global batch
between them without talking to each other.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from anchorspec.errors import AnchorspecError

from ..data.chat import DROP, KEEP, System, render_with_loss_mask
from ..data.readers import ReadStats, read_text, jsonl_rows, read_sharegpt
from ..data.regenerate import SHAREGPT_ALIAS, sharegpt_dump_path


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class DataStats:
    conversations: int = 0
    examples: int = 0
    dropped_too_long: int = 0
    dropped_no_loss: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    per_source: dict = field(default_factory=dict)


def read_conversations(path: str) -> list[list[dict]]:
    """Conversations from ``sharegpt`` (the PyPI dump), a ShareGPT JSON array, or JSONL with
    ``messages`` (what ``anchorspec regenerate`` writes, and OpenAI-style chat data)."""
    real = sharegpt_dump_path() if path == SHAREGPT_ALIAS else Path(path)
    text = read_text(real)
    if text.lstrip("\ufeff \t\r\n").startswith("["):
        return list(read_sharegpt(real, ReadStats()))
    out = []
    for n, row in jsonl_rows(real, text):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise AnchorspecError(f"{real}:{n}: expected an object with a non-empty 'messages' list "
                                  f"(train data is conversations; answer prompt lists with `anchorspec regenerate`)")
        out.append(msgs)
    return out


def tokenize_conversations(tokenizer, conversations, max_len: int, system: System | str | None = KEEP,
                           system_choices: list | None = None, seed: int = 0,
                           stats: DataStats | None = None) -> list[Example]:
    """Render every conversation with its loss mask. Longer than ``max_len`` is dropped, not cut
    (EAGLE's rule: a cut reply would teach the drafter a turn that never ends). With
    ``system_choices`` each conversation gets a seeded draw from them (None = no system prompt)."""
    stats = stats if stats is not None else DataStats()
    rng = random.Random(seed)
    out = []
    for conv in conversations:
        stats.conversations += 1
        choice = system_choices[rng.randrange(len(system_choices))] if system_choices else system
        ids, mask = render_with_loss_mask(tokenizer, conv, DROP if choice is None else choice)
        if len(ids) > max_len:
            stats.dropped_too_long += 1
            continue
        if sum(mask) == 0:
            stats.dropped_no_loss += 1
            continue
        out.append(Example(ids, mask))
        stats.examples += 1
        stats.tokens += len(ids)
        stats.loss_tokens += sum(mask)
    return out


def keep_fitting(examples, max_len: int, stats: DataStats) -> list[Example]:
    """Examples given as token ids (a corpus), with the rules of `tokenize_conversations`."""
    out = []
    for e in examples:
        stats.conversations += 1
        if len(e.input_ids) > max_len:
            stats.dropped_too_long += 1
        elif sum(e.loss_mask) == 0:
            stats.dropped_no_loss += 1
        else:
            out.append(Example(list(e.input_ids), list(e.loss_mask)))
            stats.examples += 1
            stats.tokens += len(e.input_ids)
            stats.loss_tokens += sum(e.loss_mask)
    return out


def join_examples(examples: list[Example], join_to: int, share: float, seed: int) -> list[Example]:
    """Long multi-turn sequences out of short examples, so that a drafter trains at positions its data
    never reaches alone (the corpus stops at 1,024 tokens). In a seeded order, a ``share`` of the examples
    is chained, each after the last, into sequences of at most ``join_to`` tokens; each keeps its own
    system turn and loss mask, and the target's soft labels are computed over the whole sequence, so every
    label is the target's own prediction in that long context. The rest stay alone (positions from 0 keep
    their weight). Returns the joined sequences, then the examples left alone."""
    if not 0 < share <= 1:
        raise AnchorspecError(f"--join-share must be in (0, 1], got {share}")
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    cut = round(share * len(order))
    joined: list[Example] = []
    ids: list[int] = []
    mask: list[int] = []
    for i in order[:cut]:
        e = examples[i]
        if ids and len(ids) + len(e.input_ids) > join_to:
            joined.append(Example(ids, mask))
            ids, mask = [], []
        ids.extend(e.input_ids)  # a fresh list per sequence (rebound above), never an example's own
        mask.extend(e.loss_mask)
    if ids:
        joined.append(Example(ids, mask))
    return joined + [examples[i] for i in order[cut:]]


def split_heldout(sequences: list[list[int]], fraction: float, seed: int,
                  minimum: int = 1) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices). An example is held out by a seeded hash of its tokens, not
    its position, so the held-out set stays the same examples when the corpus grows (a drafter
    continued with --init-from on more data is never evaluated on what it trained on). At least
    ``minimum`` are held out (the lowest hashes) and at least one example is kept for training."""
    n = len(sequences)
    if n < 2:
        raise AnchorspecError(f"need at least 2 training examples to hold some out, got {n}")
    salt = seed.to_bytes(8, "little", signed=True)
    keys = []
    for ids in sequences:
        h = hashlib.blake2b(array("l", ids).tobytes(), digest_size=8, key=salt)
        keys.append(int.from_bytes(h.digest(), "little") / 2.0 ** 64)
    held = {i for i, k in enumerate(keys) if k < fraction}
    if len(held) < minimum:
        held = set(sorted(range(n), key=keys.__getitem__)[:minimum])
    if len(held) >= n:
        held = set(sorted(held, key=keys.__getitem__)[: n - 1])
    return [i for i in range(n) if i not in held], sorted(held)


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, pool: int = 64) -> list[list[int]]:
    """Micro-batches for one epoch: a seeded shuffle, then within pools of ``pool`` examples sorted by
    length and cut so that rows x longest <= ``batch_tokens`` (little padding), then the batches shuffled.
    Pure in (lengths, batch_tokens, seed, epoch)."""
    if any(L > batch_tokens for L in lengths):
        raise AnchorspecError(f"--batch-tokens {batch_tokens} is smaller than the longest example "
                              f"({max(lengths)} tokens); raise it or lower --max-len")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for s in range(0, len(order), pool):
        chunk = sorted(order[s: s + pool], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:
            if batch and (len(batch) + 1) * max(lengths[i], lengths[batch[-1]]) > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


class BatchStream:
    """Micro-batch number i -> example indices, across epochs, without storing the past."""

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int):
        self.lengths, self.batch_tokens, self.seed = lengths, batch_tokens, seed
        self._last: tuple[int, list[list[int]]] | None = None
        self._counts: dict[int, int] = {}

    def epoch(self, e: int) -> list[list[int]]:
        if self._last is None or self._last[0] != e:
            self._last = (e, epoch_batches(self.lengths, self.batch_tokens, self.seed, e))
            self._counts[e] = len(self._last[1])
        return self._last[1]

    def per_epoch(self, e: int) -> int:
        if e not in self._counts:
            self.epoch(e)
        return self._counts[e]

    def locate(self, i: int) -> tuple[int, int]:
        """(epoch, index within it) of micro-batch i."""
        e = 0
        while i >= self.per_epoch(e):
            i -= self.per_epoch(e)
            e += 1
        return e, i

    def get(self, i: int) -> list[int]:
        e, j = self.locate(i)
        return self.epoch(e)[j]

    def total(self, epochs: int) -> int:
        return sum(self.per_epoch(e) for e in range(epochs))


def collate(examples: list[Example], pad_id: int = 0):
    """Right-padded tensors: input_ids, loss_mask, padding_mask (1 = real token)."""
    import torch

    T = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    lm = torch.zeros((len(examples), T), dtype=torch.long)
    pm = torch.zeros((len(examples), T), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n] = torch.tensor(e.input_ids)
        lm[r, :n] = torch.tensor(e.loss_mask)
        pm[r, :n] = 1
    return ids, lm, pm
