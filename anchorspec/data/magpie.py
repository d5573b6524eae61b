"""Prompts the target writes itself (the Magpie method): given only its chat template up to the start of a
user turn, an instruct model samples a plausible user query. Prompts are then unlimited, need no
download, and follow what the target "expects" to be asked.

Queries are sampled on regenerate's continuous-batching rounds (a finished query's slot takes the next
draw at once; no row is padded to another's length): draw j is sampled with ``draw_seed(seed, j)``, so it is
the same query whatever else is in the batch. Kept queries are written in draw order (filters applied in
that order too), as JSONL ``{"id": "magpie:<seed>:<draw>", "prompt": ..., "draw": j}`` (fsynced; with a
system prompt the id is ``magpie-<hash>:<seed>:<draw>`` and the line carries it), so
re-running with the same file continues after the last draw written and equals an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from anchorspec.decode.batch import SharedPrefix
from anchorspec.decode.sampling import SamplingParams
from anchorspec.errors import AnchorspecError

from .decontaminate import EvalFilter, words
from .readers import jsonl_lines
from .regenerate import AnswerRequest, ContinuousBatcher

_MARK = "\u2063MAGPIE\u2063"  # a placeholder no template rewrites, to find where the user's text would start


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The rendered chat up to where a user's message begins: the template's default system prompt, or
    `system`, which steers the queries toward a domain."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _MARK not in text:
        raise AnchorspecError("the chat template does not render a user message verbatim; Magpie needs that")
    return text[: text.index(_MARK)]


def draw_seed(seed: int, draw: int) -> int:
    """The sampling seed of draw ``draw``: a hash of (seed, draw), so files made with different --seed
    values never re-draw each other's queries (with ``seed + draw`` a --seed 26 file re-drew a --seed 23
    file's, and 1,076 of 1,506 "new" prompts were ones the corpus already held). 63 bits: two files' 10,000
    draws then share no seed (31 bits, as regenerate's servers take, gave a shared one)."""
    digest = hashlib.sha256(f"{seed}:magpie-draw:{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def id_prefix(seed: int, system: str | None) -> str:
    """`magpie:<seed>`, or with a system prompt `magpie-<8 hex of its hash>:<seed>`: ids stay unique across
    files (--skip-packed and the corpus match prompts by id), and the corpus counts each steer apart."""
    if not system:
        return f"magpie:{seed}"
    return f"magpie-{hashlib.sha256(system.encode()).hexdigest()[:8]}:{seed}"


def _done(out: Path, system: str | None) -> tuple[int, list[str]]:
    """(draws already made, kept prompts) of an existing output file; a cut-off last line is removed."""
    if not out.exists():
        return 0, []
    raw = out.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    lines = [json.loads(x) for x in jsonl_lines(keep.decode()) if x.strip()]
    if any("draw" not in r for r in lines):
        raise AnchorspecError(f"{out} was written by an older synth-prompts (batches, not draws); use another --out")
    steers = {r.get("system") or None for r in lines}
    if steers and steers != {system or None}:
        raise AnchorspecError(f"{out} was written with system prompt {next(iter(steers))!r}, not {system or None!r}; "
                              "give the same --system or another --out")
    return max((int(r["draw"]) + 1 for r in lines), default=0), [r["prompt"] for r in lines]


def synthesize_prompts(target, out_path, n: int, *, batch_size: int = 32, max_new_tokens: int = 96,
                       temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, min_words: int = 3,
                       eval_filter: EvalFilter | None = None, progress: bool = True,
                       shared_prefix: bool = True, system: str | None = None) -> dict:
    """Append sampled user queries to ``out_path`` (the target: a models.target.Target) until it holds
    ``n``. Queries that run into the token limit (unfinished), have fewer than ``min_words`` words, repeat
    an earlier one, or contain an evaluation prompt are dropped (and counted). `shared_prefix=False`
    prefills every draw's prompt alone (the path before shared prefixes; kept to benchmark against).
    `system`: the system prompt the queries are sampled under (answers are regenerated under the
    template's default one, as users ask), recorded on every line."""
    from ..progress import progress_bar

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    next_draw, kept = _done(out, system)
    have = len(kept)
    seen = {" ".join(words(p)) for p in kept}
    tokenizer = target.tokenizer
    prefix = tokenizer(user_turn_prefix(tokenizer, system), add_special_tokens=False)["input_ids"]
    eot = tokenizer.eos_token_id  # ChatML's <|im_end|>: the end of the user's turn
    # every draw's prompt is the same prefix: its rows are computed once, and a new draw joins the
    # next round's batched forward instead of prefilling alone
    shared = SharedPrefix.build(target, prefix[:-1]) if shared_prefix and len(prefix) > 1 else None
    batcher = ContinuousBatcher(target, batch_size, max_new_tokens, SamplingParams(temperature, top_p), (eot,),
                                prefix=shared)
    counts = {"unfinished": 0, "short": 0, "duplicate": 0, "contaminated": 0}
    new_tokens, t0 = 0, time.perf_counter()
    issued = next_draw
    finished: dict[int, list[int] | None] = {}  # draw -> its query's tokens (None: unfinished), until written

    def top_up() -> None:
        """Queue draws until those not yet written cover what is still needed, plus a batch (drops use some)."""
        nonlocal issued
        while have < n and issued - next_draw < batch_size + (n - have):
            batcher.add(AnswerRequest(issued, prefix, draw_seed(seed, issued)))
            issued += 1

    def verdict(tokens: list[int] | None) -> tuple[str | None, str]:
        """(why the query is dropped, or None if it is kept (and remembered); its text)."""
        if tokens is None:
            return "unfinished", ""
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        key = " ".join(words(text))
        if len(key.split()) < min_words:
            return "short", text
        if key in seen:
            return "duplicate", text
        if eval_filter is not None and eval_filter.matches(text):
            return "contaminated", text
        seen.add(key)
        return None, text

    bar = progress_bar(total=n, initial=min(have, n), desc="magpie", unit="prompt", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        top_up()
        for request, res in batcher.run():
            new_tokens += len(res.token_ids)
            finished[request.key] = res.token_ids[:-1] if res.finish_reason == "stop" else None
            rows: list[dict] = []
            while next_draw in finished and have + len(rows) < n:  # in draw order: resumable, deterministic
                why, text = verdict(finished.pop(next_draw))
                if why:
                    counts[why] += 1
                else:
                    rows.append({"id": f"{id_prefix(seed, system)}:{next_draw}", "prompt": text, "draw": next_draw,
                                 **({"system": system} if system else {})})
                next_draw += 1
            if rows:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())
                have += len(rows)
                bar.update(len(rows))
            if have >= n:
                break
            top_up()
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s")
    bar.close()
    return {"prompts": have, "draws": next_draw, "dropped": counts, "new_tokens": new_tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
