"""Keep evaluation prompts out of training data: normalised n-gram matching against every
evaluation set the project reports on, and de-duplication of training prompts.

A training text is *contaminated* when, after normalisation (Unicode NFKC, lower case, words of
letters and digits only), it shares a run of ``NGRAM`` consecutive words with an evaluation prompt,
or, for evaluation prompts shorter than that, contains the whole prompt as a run of words. The
13-word run is the rule GPT-3 and most decontamination reports use: long enough that common
phrases ("write a python function that returns the") do not match, short enough that a pasted
question with a different preamble, casing or punctuation still does. Prompts of fewer than
``MIN_CONTAINED`` words (generic follow-ups such as "Can you parallelize it?") match only a text
that is exactly them.
"""

from __future__ import annotations

import gzip
import json
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from anchorspec.errors import AnchorspecError

NGRAM = 13
MIN_CONTAINED = 6  # eval prompts shorter than this ("Can you parallelize it?") match only a whole text
_WORD = re.compile(r"[^\W_]+", re.UNICODE)

# (relative path, how to read it): every prompt the project evaluates on, all turns.
EVAL_SOURCES = (
    ("mt_bench/question.jsonl", "turns"),
    ("eagle_eval/mt_bench/question.jsonl", "turns"),
    ("eagle_eval/alpaca/question.jsonl", "turns"),
    ("eagle_eval/gsm8k/question.jsonl", "turns"),
    ("eagle_eval/humaneval/question.jsonl", "turns"),
    ("eagle_eval/qa/question.jsonl", "turns"),
    ("eagle_eval/sum/question.jsonl", "turns"),
    ("gsm8k/test.jsonl", "question"),
    ("humaneval/HumanEval.jsonl.gz", "prompt"),
    ("long_context/paul_graham_essays", "text"),  # a folder of .txt documents: the long-context workloads' essays
)


def words(text: str) -> list[str]:
    """The normalised words of a text (NFKC, case-folded, letters and digits only)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def _key(ws: list[str]) -> int:
    # Python's tuple hash (per process, like the index itself): 64 bits, far less memory than word tuples.
    return hash(tuple(ws))


def _rows(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise AnchorspecError(f"{path}:{n}: not valid JSON ({exc.msg})") from None


def eval_prompts(data_dir: str | Path) -> dict[str, list[str]]:
    """Every evaluation prompt under ``data_dir`` (the layout of ../shared/data), per source file.
    Files that are absent are left out; a ``data_dir`` with none of them is an error."""
    root = Path(data_dir)
    out: dict[str, list[str]] = {}
    for rel, how in EVAL_SOURCES:
        path = root / rel
        if how == "text":
            documents = sorted(path.glob("*.txt")) if path.is_dir() else []
            if documents:
                out[rel] = [p.read_text(encoding="utf-8") for p in documents]
            continue
        if not path.is_file():
            continue
        texts = []
        for row in _rows(path):
            value = row.get(how) if isinstance(row, dict) else None
            texts += [t for t in (value if isinstance(value, list) else [value]) if isinstance(t, str)]
        out[rel] = texts
    if not out:
        raise AnchorspecError(f"{root}: no evaluation sets found (expected e.g. {EVAL_SOURCES[0][0]}); "
                              f"pass the folder that holds them (--eval-data)")
    return out


@dataclass
class EvalFilter:
    """Answers "does this text contain an evaluation prompt?" in time linear in the text."""
    long_grams: set[int] = field(default_factory=set)  # NGRAM-word runs of the longer eval prompts
    short: dict[int, set[int]] = field(default_factory=dict)  # word count -> whole short eval prompts
    tiny: set[int] = field(default_factory=set)  # prompts under MIN_CONTAINED words: whole-text match only
    sources: dict[str, int] = field(default_factory=dict)  # eval file -> prompts indexed

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "EvalFilter":
        f = cls()
        f.add(texts)
        return f

    @classmethod
    def from_data_dir(cls, data_dir: str | Path) -> "EvalFilter":
        f = cls()
        for rel, texts in eval_prompts(data_dir).items():
            f.add(texts)
            f.sources[rel] = len(texts)
        return f

    def add(self, texts: Iterable[str]) -> None:
        for text in texts:
            ws = words(text)
            if not ws:
                continue
            if len(ws) >= NGRAM:
                self.long_grams.update(_key(ws[i:i + NGRAM]) for i in range(len(ws) - NGRAM + 1))
            elif len(ws) >= MIN_CONTAINED:
                self.short.setdefault(len(ws), set()).add(_key(ws))
            else:
                self.tiny.add(_key(ws))

    def matches(self, text: str) -> bool:
        ws = words(text)
        if _key(ws) in self.tiny:
            return True
        if any(_key(ws[i:i + NGRAM]) in self.long_grams for i in range(len(ws) - NGRAM + 1)):
            return True
        return any(_key(ws[i:i + n]) in keys for n, keys in self.short.items() for i in range(len(ws) - n + 1))


def dedupe_key(messages: list[dict]) -> str:
    """Two prompts are duplicates when their normalised user turns are equal."""
    return " | ".join(" ".join(words(m["content"])) for m in messages if m.get("role") == "user")


@dataclass
class FilterReport:
    kept: int = 0
    contaminated: int = 0
    duplicates: int = 0

    def line(self) -> str:
        return (f"kept {self.kept} prompts; dropped {self.contaminated} that contain an evaluation prompt "
                f"and {self.duplicates} duplicates")


def clean_conversations(conversations: Iterable[list[dict]], eval_filter: EvalFilter | None,
                        report: FilterReport | None = None, seen: set[str] | None = None) -> Iterator[list[dict]]:
    """Conversations whose user turns contain no evaluation prompt, first occurrence of each only
    (``seen``: dedupe keys of conversations kept earlier, e.g. already in a corpus)."""
    report = report if report is not None else FilterReport()
    seen = seen if seen is not None else set()
    for messages in conversations:
        key = dedupe_key(messages)
        if key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        if eval_filter is not None and any(eval_filter.matches(m["content"]) for m in messages
                                           if m.get("role") == "user"):
            report.contaminated += 1
            continue
        report.kept += 1
        yield messages
