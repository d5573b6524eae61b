"""A released training corpus: regenerated conversations as compact token ids, in parts.

Regeneration is the expensive half of making a drafter, so its output is kept and committed:
the next session trains on it instead of regenerating. A corpus is a folder of parts:

    part-0000.npz   tokens (uint16 when the vocabulary fits, else int32), offsets (int64, one per
                    conversation + 1), loss (uint8, 1 = an assistant token the drafter learns);
                    np.savez_compressed
    part-0000.json  provenance: where the prompts came from, the target and its dtype, the sampling
                    settings, the chat template rendering, counts, and the npz's sha256

Token ids are the conversation as the target's chat template renders it (its default system
prompt kept), so a part is tied to one target tokenizer: `read_corpus` checks the vocabulary size.
Parts are written atomically; a folder can grow by parts across sessions. `FOLDER:0004,0032-0038`
reads only those parts (a round on the newest data names them instead of linking them into a folder).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anchorspec.atomic import atomic_write, atomic_write_text
from anchorspec.errors import AnchorspecError

from .chat import KEEP, render_with_loss_mask

FORMAT = 1


@dataclass
class CorpusExample:
    input_ids: list[int]
    loss_mask: list[int]


_SELECTION = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def split_selection(spec: str | Path) -> tuple[Path, list[int] | None]:
    """`FOLDER` -> (FOLDER, None); `FOLDER:0004,0032-0038` -> (FOLDER, [4, 32, ..., 38]). A path that exists
    as written is a folder even when its name has a colon."""
    text = str(spec)
    folder, colon, selection = text.rpartition(":")
    if not colon or Path(text).exists() or not _SELECTION.fullmatch(selection):
        return Path(text), None
    numbers: set[int] = set()
    for item in selection.split(","):
        first, _, last = item.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise AnchorspecError(f"{spec}: part range {item} runs backwards")
        numbers.update(range(lo, hi + 1))
    return Path(folder), sorted(numbers)


def corpus_parts(spec: str | Path) -> list[Path]:
    """The part files a corpus spec names, in part order: every part of a folder, or the selected ones
    (each must exist)."""
    folder, chosen = split_selection(spec)
    parts = sorted(folder.glob("part-*.npz"))
    if not parts:
        raise AnchorspecError(f"{folder}: no corpus parts (part-*.npz)")
    if chosen is None:
        return parts
    by_number = {_part_number(p): p for p in parts}
    missing = [k for k in chosen if k not in by_number]
    if missing:
        raise AnchorspecError(f"{folder} has no part {', '.join(f'{k:04d}' for k in missing)}")
    return [by_number[k] for k in chosen]


def is_corpus(path: str | Path) -> bool:
    """A folder of parts, or a selection of its parts (`FOLDER:0004,0032-0038`)."""
    p, _ = split_selection(path)
    return p.is_dir() and any(p.glob("part-*.npz"))


def _part_number(npz: Path) -> int | None:
    """NNNN of `part-NNNN.npz` (None for a name that is not a number)."""
    tail = npz.stem.split("-")[1]
    return int(tail) if tail.isdigit() else None


def _next_part(folder: Path) -> int:
    used = [k for k in map(_part_number, folder.glob("part-*.npz")) if k is not None]
    return max(used, default=-1) + 1


def write_part(folder: str | Path, examples: Iterable[tuple[list[int], list[int]]], vocab_size: int,
               provenance: dict) -> Path:
    """Append one part made of (input_ids, loss_mask) pairs; returns the .npz path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids, loss, offsets = [], [], [0]
    for input_ids, mask in examples:
        if len(input_ids) != len(mask):
            raise AnchorspecError(f"input_ids and loss_mask differ in length ({len(input_ids)} vs {len(mask)})")
        ids += input_ids
        loss += mask
        offsets.append(len(ids))
    if len(offsets) == 1:
        raise AnchorspecError("a corpus part needs at least one conversation")
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=np.asarray(ids, dtype=dtype), offsets=np.asarray(offsets, dtype=np.int64),
                        loss=np.asarray(loss, dtype=np.uint8))
    blob = buf.getvalue()
    k = _next_part(folder)
    npz = folder / f"part-{k:04d}.npz"
    meta = {"format": FORMAT, "vocab_size": int(vocab_size), "conversations": len(offsets) - 1,
            "tokens": len(ids), "loss_tokens": int(sum(loss)), "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(), **provenance}
    atomic_write(npz, lambda tmp: Path(tmp).write_bytes(blob))
    atomic_write_text(npz.with_suffix(".json"), json.dumps(meta, indent=2) + "\n")
    return npz


def pack_conversations(folder: str | Path, conversations: Iterable[list[dict]], tokenizer, provenance: dict,
                       vocab_size: int | None = None) -> Path:
    """Render conversations with the chat template (default system prompt kept) and write one part."""
    pairs = (render_with_loss_mask(tokenizer, conv, KEEP) for conv in conversations)
    return write_part(folder, pairs, vocab_size or len(tokenizer), provenance)


def read_corpus(folder: str | Path, vocab_size: int | None = None) -> list[CorpusExample]:
    """Every conversation of every part (or of the selected parts: `FOLDER:0004,0032-0038`), in part order.
    Checks each part's hash and vocabulary."""
    out = []
    for npz in corpus_parts(folder):
        out += read_part(npz, vocab_size)
    return out


def read_part(npz: str | Path, vocab_size: int | None = None) -> list[CorpusExample]:
    """The conversations of one part (`part-NNNN.npz`), after checking its hash and vocabulary."""
    npz = Path(npz)
    tokens, offsets, loss = _part_arrays(npz, _part_meta(npz), vocab_size)
    return [CorpusExample(tokens[a:b].tolist(), loss[a:b].tolist())
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def _part_meta(npz: Path) -> dict:
    meta_path = npz.with_suffix(".json")
    if not meta_path.is_file():
        raise AnchorspecError(f"{npz}: its provenance {meta_path.name} is missing")
    return json.loads(meta_path.read_text())


def _part_arrays(npz: Path, meta: dict, vocab_size: int | None = None):
    """(tokens int64, offsets, loss) of one part, after checking its hash and vocabulary against `meta`."""
    blob = npz.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise AnchorspecError(f"{npz}: sha256 differs from {npz.with_suffix('.json').name} (corrupt or partly copied)")
    if vocab_size is not None and meta.get("vocab_size") != vocab_size:
        raise AnchorspecError(f"{npz}: made for a vocabulary of {meta.get('vocab_size')} tokens, "
                              f"the target has {vocab_size}")
    with np.load(io.BytesIO(blob)) as z:
        return z["tokens"].astype(np.int64), z["offsets"], z["loss"]


def iter_packed(folder: str | Path, ids: set[str] | None = None, vocab_size: int | None = None):
    """(record id, token ids, loss mask) of the packed conversations, in part order; only those
    whose ids are in `ids` when it is given. A part's provenance lists its records' ids in order;
    parts without ids (packed before ids were kept) are skipped."""
    if not is_corpus(folder):
        raise AnchorspecError(f"{folder} is not a corpus folder (no part-*.npz)")
    for npz in corpus_parts(folder):
        meta = _part_meta(npz)
        part_ids = meta.get("ids") or []
        rows = [k for k, pid in enumerate(part_ids) if ids is None or pid in ids]
        if not rows:
            continue
        tokens, offsets, loss = _part_arrays(npz, meta, vocab_size)
        if len(offsets) - 1 != len(part_ids):
            raise AnchorspecError(f"{npz}: {len(offsets) - 1} conversations but {len(part_ids)} ids in its provenance")
        for k in rows:
            a, b = int(offsets[k]), int(offsets[k + 1])
            yield part_ids[k], tokens[a:b].tolist(), loss[a:b].tolist()


def packed_conversations(folder: str | Path, ids: set[str]) -> dict[str, tuple[list[int], list[int]]]:
    """{id: (token ids, loss mask)} of the packed conversations with these record ids."""
    return {pid: (tokens, loss) for pid, tokens, loss in iter_packed(folder, ids)}


def corpus_summary(folder: str | Path) -> dict:
    """Totals over a corpus's parts, from their provenance files (for model cards and logs)."""
    metas = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("part-*.json"))]
    return {"parts": len(metas), "conversations": sum(m["conversations"] for m in metas),
            "tokens": sum(m["tokens"] for m in metas), "loss_tokens": sum(m["loss_tokens"] for m in metas),
            "bytes": sum(m["bytes"] for m in metas)}


def packed_ids(folder: str | Path) -> set[str]:
    """Record ids already in some part (so a growing answers file is packed incrementally)."""
    out: set[str] = set()
    for p in Path(folder).glob("part-*.json"):
        out.update(json.loads(p.read_text()).get("ids", []))
    return out


def pack_answers(answer_files: list[str], folder: str | Path, target: str, eval_data: str | Path | None,
                 info: dict | None = None, max_tokens_per_part: int = 2_000_000) -> dict:
    """Add the records of `anchorspec regenerate` output files that no part holds yet, minus
    conversations that contain an evaluation prompt and duplicates, as new parts."""
    from transformers import AutoTokenizer

    from ..models.hub import resolve_target
    from .decontaminate import EvalFilter, FilterReport, clean_conversations, dedupe_key
    from .readers import jsonl_rows

    eval_filter = EvalFilter.from_data_dir(eval_data) if eval_data is not None else None
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(target))
    done = packed_ids(folder)
    packed_keys: set[str] = set()
    records, already = [], 0
    for path in answer_files:
        for n, row in jsonl_rows(path):
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or "id" not in row:
                raise AnchorspecError(f"{path}:{n}: not a regenerate record (id, messages)")
            if row["id"] not in done:
                done.add(row["id"])
                records.append(row)
            else:  # already in a part: a new record with the same prompt is a duplicate
                packed_keys.add(dedupe_key(row["messages"]))
                already += 1
    report = FilterReport()
    by_key = {id(r["messages"]): r for r in records}
    kept = [by_key[id(m)] for m in clean_conversations((r["messages"] for r in records), eval_filter, report,
                                                        seen=packed_keys)]
    parts, batch, tokens = [], [], 0
    base = {"target": target, "template": "chat template, default system prompt kept", **(info or {}),
            "eval_filter": sorted(eval_filter.sources) if eval_filter else None}

    def flush():
        sources: dict[str, int] = {}
        for r, _ in batch:
            src = str(r["id"]).rsplit(":", 1)[0]
            sources[src] = sources.get(src, 0) + 1
        finishes = [r.get("finish") for r, _ in batch]
        prov = {**base, "sources": sources, "finish_stop": finishes.count("stop"),
                "finish_length": finishes.count("length"), "ids": [r["id"] for r, _ in batch]}
        parts.append(str(write_part(folder, [p for _, p in batch], len(tokenizer), prov)))

    for r in kept:
        pair = render_with_loss_mask(tokenizer, r["messages"], KEEP, context_replies=int(r.get("context_replies", 0)))
        batch.append((r, pair))
        tokens += len(pair[0])
        if tokens >= max_tokens_per_part:
            flush()
            batch, tokens = [], 0
    if batch:
        flush()
    return {"new_records": len(records), "already_packed": already, "kept": report.kept,
            "contaminated": report.contaminated, "duplicates": report.duplicates, **corpus_summary(folder),
            "new_parts": parts}
