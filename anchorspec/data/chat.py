"""Render a conversation with the target's chat template and mark the tokens the drafter learns (loss mask).

The mask covers each assistant reply *as the template renders it*, up to and including the template's
end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``): the drafter must learn to end turns.
Whitespace the template puts after that token (ChatML's ``<|im_end|>\\n``) is not masked: it is
template glue the target never has to predict before the turn is over.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Sequence

from anchorspec.errors import AnchorspecError

ROLES = ("system", "user", "assistant")


class System(enum.Enum):
    KEEP = "keep"  # use the conversation's own system message(s), if any
    DROP = "drop"  # remove every system message


KEEP = System.KEEP
DROP = System.DROP


def with_system(conversation: Sequence[dict], system: System | str | None = KEEP) -> list[dict]:
    """The conversation with its system prompt kept, dropped (DROP or None) or replaced by a string."""
    if system is KEEP:
        return [dict(m) for m in conversation]
    rest = [dict(m) for m in conversation if m.get("role") != "system"]
    if system is DROP or system is None:
        return rest
    if not isinstance(system, str):
        raise AnchorspecError(f"system must be KEEP, DROP, None or a string, got {system!r:.80}")
    return [{"role": "system", "content": system}] + rest


def vary_system(conversations: Iterable[Sequence[dict]], choices: Sequence[str | None], seed: int = 0) -> list[list[dict]]:
    """Each conversation with a system prompt drawn from ``choices`` (None = no system prompt).

    The draw depends only on (seed, position), so reruns give the same data: EAGLE-3.1's robustness
    axis is training on varied and absent system prompts instead of one fixed prompt.
    """
    if not choices:
        raise AnchorspecError("vary_system needs at least one choice (a string, or None for no system prompt)")
    rng = random.Random(seed)
    return [with_system(conv, choices[rng.randrange(len(choices))]) for conv in conversations]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the reply
    (the one place prompts are encoded: generation, serving and regeneration)."""
    if not tokenizer.chat_template:
        raise AnchorspecError("--chat needs a tokenizer with a chat template; this target has none")
    # What apply_chat_template(tokenize=True) does (render, then encode without extra special tokens: the
    # template writes them), spelt out so messages_from_prompt checks a read-back prompt with the same two
    # steps (tested equal to apply_chat_template; no faster: the tokenizer dominates either way).
    return _encode(tokenizer, _render(tokenizer, messages, True))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja errors (raise_exception, undefined) come in many types
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AnchorspecError(f"chat template failed on {len(messages)} messages "
                              f"(roles {[m['role'] for m in messages]}): {first}") from exc
    if not isinstance(text, str):
        raise AnchorspecError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the [start, end) character span of each assistant reply in it.

    Span i is text(messages[:i+1]) minus text(messages[:i], generation prompt), with trailing
    whitespace removed. That needs the template to be prefix-stable: every partial rendering must be
    a prefix of the next and of the full text; templates that re-render history (e.g. stripping
    reasoning from earlier turns) fail with AnchorspecError rather than produce a wrong mask.
    """
    full = _render(tokenizer, messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not upto.startswith(prompt):
            raise AnchorspecError(
                f"chat template is not prefix-stable: the generation prompt for assistant message {i} "
                f"({prompt[-40:]!r}) is not a prefix of the rendered reply (near {upto[max(0, len(prompt) - 40):len(prompt) + 20]!r})")
        if not full.startswith(upto):
            raise AnchorspecError(
                f"chat template is not prefix-stable: messages[:{i + 1}] render differently inside the full "
                f"conversation (e.g. history re-rendered once later turns exist)")
        reply = upto[len(prompt):].rstrip()
        if msg["content"].strip() not in reply:
            raise AnchorspecError(f"chat template rewrites assistant message {i}: its content is not in the "
                                  f"rendered reply {reply[:60]!r}")
        spans.append((len(prompt), len(prompt) + len(reply)))
    return full, spans


def first_answer(input_ids: list[int], loss_mask: list[int]) -> tuple[list[int], int] | None:
    """(the sequence up to the end of its first trained span, the span's first index); None when
    nothing is trained. The span is an answer as `generate` would write it after that prompt."""
    start = next((i for i, m in enumerate(loss_mask) if m), None)
    if start is None:
        return None
    end = start
    while end < len(loss_mask) and loss_mask[end]:
        end += 1
    return list(input_ids[:end]), start


def render_with_loss_mask(tokenizer, conversation: Sequence[dict], system: System | str | None = KEEP,
                          context_replies: int = 0) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation; loss_mask[t] = 1 for tokens of assistant replies,
    except the first `context_replies` of them (context another record already trains on).

    The text is tokenized once, without extra special tokens (the template already writes BOS), so
    input_ids are exactly what the target sees. A token is masked when its character span lies
    inside an assistant span; a token straddling the template/reply boundary is not masked.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise AnchorspecError(f"{type(tokenizer).__name__} is not a fast tokenizer: offsets are needed for the loss mask")
    messages = with_system(conversation, system)
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise AnchorspecError(f"message {k} must have role in {ROLES} and string content, got {m!r:.80}")
    text, spans = assistant_spans(tokenizer, messages)
    if not 0 <= context_replies <= len(spans):
        raise AnchorspecError(f"context_replies {context_replies} for a conversation of {len(spans)} assistant replies")
    spans = spans[context_replies:]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    j = 0  # spans and offsets are both ascending: one merge-like pass
    for t, (s, e) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and e > s and spans[j][0] <= s and e <= spans[j][1]:
            mask[t] = 1
    return ids, mask


def template_markers(tokenizer) -> tuple[str, dict[str, str], str, str] | None:
    """(lead, the opening text of each role's turn, the text that closes a turn, the generation
    prompt) of templates that render every message as ``open(role) + content + close``, learnt by
    rendering sentinel messages; None when the template is not of that form."""
    a, b, c = "\ue000", "\ue001", "\ue002"
    try:
        two = _render(tokenizer, [{"role": "system", "content": a}, {"role": "user", "content": b}], False)
        three = _render(tokenizer, [{"role": "system", "content": a}, {"role": "user", "content": b},
                                    {"role": "assistant", "content": c}], False)
        gen = _render(tokenizer, [{"role": "system", "content": a}, {"role": "user", "content": b}], True)
    except AnchorspecError:
        return None
    if not (two.count(a) == two.count(b) == 1 and gen.startswith(two) and three.startswith(two)):
        return None
    close = two[two.index(b) + 1:]
    between = two[two.index(a) + 1: two.index(b)]
    if not close or not between.startswith(close):
        return None
    opens = {"user": between[len(close):], "assistant": gen[len(two):]}
    if three[len(two):] != opens["assistant"] + c + close or "user" not in opens["user"]:
        return None
    opens["system"] = opens["user"].replace("user", "system", 1)
    head = two[: two.index(a)]
    if not head.endswith(opens["system"]):
        return None
    return head[: len(head) - len(opens["system"])], opens, close, opens["assistant"]


def messages_from_prompt(tokenizer, ids: Sequence[int], markers=None) -> list[dict] | None:
    """The messages whose chat-template rendering, ready for the reply, is exactly `ids` (what
    `prompt_ids` would encode); None when they cannot be recovered. Read back from a packed corpus,
    so its prompts can be answered again (e.g. sampled twins of greedy answers) without their
    sources. The decoded text is split at the template's turn markers and the result is kept only if
    it encodes back to the same ids, so a template or tokenizer this cannot read costs a skipped
    prompt, never a wrong one. `markers`: `template_markers(tokenizer)`, when reading many."""
    markers = markers or template_markers(tokenizer)
    if markers is None:
        return None
    lead, opens, close, gen = markers
    text = tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not text.startswith(lead) or not text.endswith(gen):
        return None
    body, pos, messages = text[: len(text) - len(gen)], len(lead), []
    while pos < len(body):
        role = next((r for r in ROLES if body.startswith(opens[r], pos)), None)
        if role is None:
            return None
        start = pos + len(opens[role])
        end = body.find(close, start)
        if end < 0:
            return None
        messages.append({"role": role, "content": body[start:end]})
        pos = end + len(close)
    # the messages must render to the decoded text and that text encode to the same ids (= prompt_ids)
    if not messages or messages[-1]["role"] != "user" or _render(tokenizer, messages, True) != text:
        return None
    return messages if _encode(tokenizer, text) == list(ids) else None
