"""Readers for training and evaluation data: ShareGPT dumps, chat JSONL, MT-bench turns, prompt lists.

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}`` dicts.
Bad input raises AnchorspecError with one line naming the file, the line and the offending value.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from anchorspec.errors import AnchorspecError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names; "chatgpt"/"bing" are assistant turns in some dumps. Any other speaker is dropped.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "assistant": "assistant", "system": "system"}
PROMPT_FIELDS = ("prompt", "instruction", "question")


def read_text(path) -> str:
    path = Path(path)
    if not path.is_file():
        raise AnchorspecError(f"data file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise AnchorspecError(f"cannot read {path}: {exc}") from None


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSONL text. Only "\n" ends a line: `str.splitlines` also splits at U+2028, U+0085
    and other characters that `json.dumps(..., ensure_ascii=False)` leaves raw inside strings."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def jsonl_rows(path, text: str | None = None) -> Iterator[tuple[int, object]]:
    """(line number, decoded value) for each non-blank line."""
    for n, line in enumerate(jsonl_lines(read_text(path) if text is None else text), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise AnchorspecError(f"{path}:{n}: not valid JSON ({exc.msg})") from None


@dataclass
class ReadStats:
    """What a ShareGPT read recovered; filled in as the reader runs (complete once it is exhausted)."""
    items: int = 0  # complete array elements decoded
    kept: int = 0  # conversations yielded
    dropped: int = 0  # elements with no usable user turn
    truncated: bool = False  # the file ended part-way through an element


def iter_json_array(text: str, path, stats: ReadStats | None = None) -> Iterator[tuple[int, object]]:
    """(line, element) for each complete element of a top-level JSON array, tolerating a cut-off tail.

    raw_decode walks the in-memory text element by element, so a dump truncated mid-element (as the
    PyPI ShareGPT copy is) still yields every element before the cut. A decode failure counts as
    truncation only when the file does not end with ']'; otherwise it is a real syntax error.
    """
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    ends_closed = text.rstrip().endswith("]")
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    i = skip_ws(0)
    if i < n and text[i] == "\ufeff":  # tolerate a BOM
        i = skip_ws(i + 1)
    if i >= n or text[i] != "[":
        raise AnchorspecError(f"{path}:{_line_of(text, i)}: expected a JSON array ('['), got {text[i:i + 20]!r}")
    i = skip_ws(i + 1)
    if i < n and text[i] == "]":
        return
    line, counted = 1, 0  # line number of position `counted`, advanced incrementally (not O(n^2))
    while True:
        if i >= n:
            break  # truncated right after a ','
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if ends_closed:
                raise AnchorspecError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
            break
        stats.items += 1
        line += text.count("\n", counted, i)
        counted = i
        yield line, obj
        i = skip_ws(end)
        if i < n and text[i] == ",":
            i = skip_ws(i + 1)
            continue
        if i < n and text[i] == "]":
            return
        if i >= n:
            break  # cut exactly after an element
        raise AnchorspecError(f"{path}:{_line_of(text, i)}: expected ',' or ']' after an array element, "
                              f"got {text[i:i + 20]!r}")
    stats.truncated = True


def sharegpt_to_conversation(turns: list[dict], where: str) -> list[dict]:
    """Map ShareGPT turns to a conversation: known speakers only, optional leading system, then
    strictly alternating user/assistant turns starting with user (cut at the first break, as chat
    templates such as Mistral's reject non-alternating roles). Returns [] when nothing usable is left."""
    mapped = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
            raise AnchorspecError(f"{where}: turn {k} must be an object with string 'from' and 'value', got {turn!r:.80}")
        role = SHAREGPT_ROLES.get(turn["from"].lower())
        if role is not None:
            mapped.append({"role": role, "content": turn["value"]})
    out = mapped[:1] if mapped and mapped[0]["role"] == "system" else []
    expect = "user"
    for msg in mapped[len(out):]:
        if msg["role"] != expect:
            break
        out.append(msg)
        expect = "assistant" if expect == "user" else "user"
    return out if any(m["role"] == "user" for m in out) else []


def read_sharegpt(path, stats: ReadStats | None = None) -> Iterator[list[dict]]:
    """Conversations from a ShareGPT JSON array (``[{"conversations": [{"from", "value"}]}]``).

    Works on truncated dumps: every complete element is used and the cut-off tail is skipped; pass
    ``stats`` to learn how many were recovered (also logged once the file is exhausted).
    """
    stats = stats if stats is not None else ReadStats()
    text = read_text(path)
    for line, item in iter_json_array(text, path, stats):
        if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
            raise AnchorspecError(f"{path}:{line}: expected an object with a 'conversations' list, got {item!r:.80}")
        conv = sharegpt_to_conversation(item["conversations"], f"{path}:{line}")
        if conv:
            stats.kept += 1
            yield conv
        else:
            stats.dropped += 1
    tail = "; file truncated, partial last element skipped" if stats.truncated else ""
    log.info("%s: %d complete items, %d conversations kept, %d dropped%s",
             path, stats.items, stats.kept, stats.dropped, tail)


def check_message(msg, where: str, k: int) -> dict:
    if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
        raise AnchorspecError(f"{where}: message {k} must have role in {ROLES} and string content, got {msg!r:.80}")
    return {"role": msg["role"], "content": msg["content"]}


def read_messages_jsonl(path) -> list[list[dict]]:
    """Conversations from OpenAI-style JSONL: one ``{"messages": [{"role", "content"}]}`` per line."""
    out = []
    for n, row in jsonl_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise AnchorspecError(f"{path}:{n}: expected an object with a non-empty 'messages' list")
        out.append([check_message(m, f"{path}:{n}", k) for k, m in enumerate(row["messages"])])
    return out


def read_turns_jsonl(path) -> list[list[str]]:
    """User turns per row from MT-bench-style JSONL (``{"turns": [str, ...]}``), e.g. for regeneration."""
    out = []
    for n, row in jsonl_rows(path):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise AnchorspecError(f"{path}:{n}: expected an object with a non-empty 'turns' list of strings")
        out.append(list(turns))
    return out


def prompt_text(row, where: str) -> str:
    """The prompt of one row: a JSON string, an object's prompt/instruction/question field (first
    present), or MT-bench ``turns`` (the first turn)."""
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        for key in PROMPT_FIELDS:
            if isinstance(row.get(key), str):
                return row[key]
        turns = row.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
    raise AnchorspecError(f"{where}: expected a string, or an object with a 'prompt', 'instruction', "
                          f"'question' or 'turns' field, got {row!r:.80}")


def read_prompts(path, field: str | None = None) -> list[str]:
    """Prompt strings from a JSON array or JSONL (the one prompt reader of the CLI): rows as in
    `prompt_text`, or every row's ``field`` when given (e.g. GSM8K ``question``)."""
    text = read_text(path)
    if text.lstrip("\ufeff \t\r\n").startswith("["):
        rows = list(iter_json_array(text, path))
        if not text.rstrip().endswith("]"):
            raise AnchorspecError(f"{path}: JSON array is truncated (no closing ']')")
    else:
        rows = list(jsonl_rows(path, text))
    out = []
    for line, row in rows:
        if field is None:
            out.append(prompt_text(row, f"{path}:{line}"))
        elif isinstance(row, dict) and isinstance(row.get(field), str):
            out.append(row[field])
        else:
            raise AnchorspecError(f"{path}:{line}: expected an object with a string {field!r} field")
    if not out:
        raise AnchorspecError(f"prompts file {path} holds no prompts")
    return out