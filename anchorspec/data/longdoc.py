"""Long-context training prompts: a long document followed by a task about it, for the target to answer.

The corpus's conversations stop at 1,024 tokens (regenerate's --max-prompt-tokens), so no drafter trained on
them has seen a position past that, while the long-context workloads ask about 1k-8k-token essays. These
prompts fill that gap without touching the evaluation essays: each document is the assistant replies of one
ShareGPT conversation (prose the dump already holds), cut at a paragraph end to a length drawn between
``min_tokens`` and ``max_tokens``, then one task from ``TASKS`` (worded apart from the workloads' own).
Documents that share a 13-word run with any evaluation text (the essays included) are dropped.

Written as JSONL ``{"id": "longdoc:<seed>:<n>", "prompt": ...}``: `anchorspec regenerate` answers them
(with ``--max-prompt-tokens`` above ``max_tokens``) and `pack-corpus` packs the answers.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from anchorspec.atomic import atomic_write_text
from anchorspec.errors import AnchorspecError

from .decontaminate import EvalFilter

TASKS = (
    "Summarize the document above in a few sentences.",
    "List the key points of the document above as bullet points.",
    "What is the document above mainly about? Answer in one paragraph.",
    "Write a short title for the document above, then explain in two sentences why it fits.",
    "Explain the main ideas of the document above to a high-school student.",
    "What are the strengths and the weaknesses of the advice in the document above?",
    "Give a three-sentence summary of the document above, then one question it leaves open.",
    "Which part of the document above is the most useful, and why?",
    "Rewrite the first idea of the document above in plain, simple words.",
    "What would be a good follow-up question to ask after reading the document above? Answer it briefly.",
)
MIN_PARAGRAPH_CHARS = 40  # shorter pieces (headers, "Sure!") say little and are dropped from documents


def document_text(conversation: list[dict]) -> str:
    """A conversation's assistant replies as one document, paragraph by paragraph."""
    paragraphs = []
    for message in conversation:
        if message.get("role") != "assistant":
            continue
        paragraphs += [p.strip() for p in message["content"].split("\n\n") if len(p.strip()) >= MIN_PARAGRAPH_CHARS]
    return "\n\n".join(paragraphs)


def cut_to_tokens(text: str, tokenizer, size: int) -> str | None:
    """The longest run of whole leading paragraphs of at most ``size`` tokens, if it holds at least 3/4 of
    ``size`` (else None: the document is too short for the drawn size)."""
    paragraphs = text.split("\n\n")
    lengths = [len(ids) for ids in tokenizer([p + "\n\n" for p in paragraphs], add_special_tokens=False)["input_ids"]]
    total, keep = 0, 0
    for n in lengths:
        if total + n > size:
            break
        total, keep = total + n, keep + 1
    return "\n\n".join(paragraphs[:keep]) if total >= size * 3 // 4 else None


def long_document_prompts(conversations: Iterable[list[dict]], tokenizer, n: int, *, min_tokens: int,
                          max_tokens: int, seed: int, eval_filter: EvalFilter | None) -> tuple[list[dict], dict]:
    """Up to ``n`` prompts, documents drawn in a seeded order; returns (rows, counts of what was dropped)."""
    if not 0 < min_tokens <= max_tokens:
        raise AnchorspecError(f"need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    rng = random.Random(seed)
    pool = [c for c in conversations if any(m.get("role") == "assistant" for m in c)]
    rng.shuffle(pool)
    rows, counts = [], {"too_short": 0, "contaminated": 0}
    for conversation in pool:
        if len(rows) >= n:
            break
        size = rng.randint(min_tokens, max_tokens)
        text = document_text(conversation)
        if len(text) < size * 2:  # well under 4 characters a token: too short, skip the tokenizer
            counts["too_short"] += 1
            continue
        document = cut_to_tokens(text, tokenizer, size)
        if document is None:
            counts["too_short"] += 1
            continue
        if eval_filter is not None and eval_filter.matches(document):
            counts["contaminated"] += 1
            continue
        task = TASKS[rng.randrange(len(TASKS))]
        rows.append({"id": f"longdoc:{seed}:{len(rows)}", "prompt": f"{document}\n\n{task}"})
    return rows, counts


def write_prompts(rows: list[dict], out: str | Path) -> None:
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
