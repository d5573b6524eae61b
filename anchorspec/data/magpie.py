"""Prompts the target writes itself (the Magpie method): given only its chat template up to the start of a
user turn, an instruct model samples a plausible user query. Prompts are then unlimited, need no
download, and follow what the target "expects" to be asked.

Every row of a batch starts from the same prefix, so a batch needs no padding. Output is JSONL, one
``{"id": "magpie:<seed>:<n>", "prompt": ...}`` per kept query, appended batch by batch (fsynced); re-running
with the same file continues after the batches already written (batch k is sampled with
``batch_seed(seed, k)``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from anchorspec.errors import AnchorspecError

from .decontaminate import EvalFilter, words
from .readers import jsonl_lines

_MARK = "\u2063MAGPIE\u2063"  # a placeholder no template rewrites, to find where the user's text would start


def user_turn_prefix(tokenizer) -> str:
    """The rendered chat up to where a user's message begins (the template's default system prompt kept)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise AnchorspecError("the chat template does not render a user message verbatim; Magpie needs that")
    return text[: text.index(_MARK)]


def batch_seed(seed: int, batch_no: int) -> int:
    """The sampling seed of batch ``batch_no``. Not ``seed + batch_no``: then --seed 26 re-drew batches 3, 4, ...
    of a --seed 23 file, and 1,076 of 1,506 "new" prompts were ones the corpus already held."""
    return seed * 1_000_003 + batch_no


def _done(out: Path) -> tuple[int, int]:
    """(batches already written, lines) in an existing output file; a cut-off last line is removed."""
    if not out.exists():
        return 0, 0
    raw = out.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    lines = [json.loads(x) for x in jsonl_lines(keep.decode()) if x.strip()]
    batches = max((int(r["batch"]) + 1 for r in lines), default=0)
    return batches, len(lines)


def synthesize_prompts(model, tokenizer, out_path, n: int, *, batch_size: int = 32, max_new_tokens: int = 96,
                       temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, min_words: int = 3,
                       eval_filter: EvalFilter | None = None, progress: bool = True) -> dict:
    """Append sampled user queries to ``out_path`` until it holds ``n`` (or more). Queries that run into
    the token limit (unfinished), have fewer than ``min_words`` words, repeat an earlier one, or contain
    an evaluation prompt are dropped (and counted)."""
    from tqdm import tqdm

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    batch_no, have = _done(out)
    seen = {" ".join(words(json.loads(x)["prompt"])) for x in jsonl_lines(out.read_text()) if x.strip()} if have else set()
    prefix = user_turn_prefix(tokenizer)
    ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
    eot = tokenizer.eos_token_id  # ChatML's <|im_end|>: the end of the user's turn
    device = next(model.parameters()).device
    counts = {"unfinished": 0, "short": 0, "duplicate": 0, "contaminated": 0}
    new_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=n, initial=min(have, n), desc="magpie", unit="prompt", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        while have < n:
            torch.manual_seed(batch_seed(seed, batch_no))
            with torch.inference_mode():
                gen = model.generate(input_ids=ids.repeat(batch_size, 1).to(device), do_sample=True,
                                     temperature=temperature, top_p=top_p, top_k=None,
                                     max_new_tokens=max_new_tokens, eos_token_id=eot, pad_token_id=eot)
            rows = []
            for r in gen[:, ids.shape[1]:].tolist():
                if eot not in r:
                    counts["unfinished"] += 1
                    new_tokens += len(r)
                    continue
                r = r[: r.index(eot)]
                new_tokens += len(r) + 1
                text = tokenizer.decode(r, skip_special_tokens=True).strip()
                key = " ".join(words(text))
                if len(key.split()) < min_words:
                    counts["short"] += 1
                elif key in seen:
                    counts["duplicate"] += 1
                elif eval_filter is not None and eval_filter.matches(text):
                    counts["contaminated"] += 1
                else:
                    seen.add(key)
                    rows.append({"id": f"magpie:{seed}:{have + len(rows)}", "prompt": text, "batch": batch_no})
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
            have += len(rows)
            batch_no += 1
            bar.update(len(rows))
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s")
    bar.close()
    return {"prompts": have, "batches": batch_no, "dropped": counts, "new_tokens": new_tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
