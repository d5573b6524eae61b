"""Long-document training prompts (`anchorspec long-prompts`, data/longdoc.py): documents are whole leading
paragraphs of a conversation's replies within the drawn size, a task follows, evaluation text never gets in."""

from __future__ import annotations

import json
import random

import pytest

from anchorspec.cli import main
from anchorspec.data.decontaminate import EvalFilter
from anchorspec.data.longdoc import TASKS, cut_to_tokens, document_text, long_document_prompts
from anchorspec.errors import AnchorspecError
from helpers import CHAT_WORDS, save_tiny_chat_target, tiny_chat_tokenizer


def paragraph(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(CHAT_WORDS) for _ in range(n))


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Each: a user turn and two replies of 3-8 paragraphs of 15-40 words (the tiny tokenizer: a word a token)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for _ in range(2):
            turns.append({"role": "user", "content": "w1 w2 w3 " + paragraph(rng, 12)})
            turns.append({"role": "assistant", "content": "\n\n".join(paragraph(rng, rng.randint(15, 40))
                                                                     for _ in range(rng.randint(3, 8)))})
        out.append(turns)
    return out


def test_cut_keeps_whole_leading_paragraphs_within_the_size():
    tok = tiny_chat_tokenizer()
    text = "\n\n".join(" ".join(["w5"] * n) for n in (30, 30, 30, 30))
    assert cut_to_tokens(text, tok, 95) == "\n\n".join([" ".join(["w5"] * 30)] * 3)  # 3 x 30 fit, a 4th does not
    assert cut_to_tokens(text, tok, 200) is None  # 120 tokens are under 3/4 of 200: too short for that size
    assert cut_to_tokens(text, tok, 29) is None


def test_prompts_are_replies_cut_to_size_with_a_task_and_seeded():
    tok = tiny_chat_tokenizer()
    convs = conversations(60)
    rows, dropped = long_document_prompts(convs, tok, 20, min_tokens=80, max_tokens=200, seed=1, eval_filter=None)
    assert len(rows) == 20 and dropped["contaminated"] == 0
    assert [r["id"] for r in rows] == [f"longdoc:1:{i}" for i in range(20)]
    replies = {p for c in convs for p in document_text(c).split("\n\n")}
    for r in rows:
        document, task = r["prompt"].rsplit("\n\n", 1)
        assert task in TASKS
        assert all(p in replies for p in document.split("\n\n"))  # whole paragraphs of replies, no user text
        assert 60 <= len(tok(document, add_special_tokens=False)["input_ids"]) <= 200
    again, _ = long_document_prompts(convs, tok, 20, min_tokens=80, max_tokens=200, seed=1, eval_filter=None)
    other, _ = long_document_prompts(convs, tok, 20, min_tokens=80, max_tokens=200, seed=2, eval_filter=None)
    assert again == rows and other != rows
    with pytest.raises(AnchorspecError, match="min_tokens"):
        long_document_prompts(convs, tok, 5, min_tokens=300, max_tokens=200, seed=1, eval_filter=None)


def test_documents_holding_evaluation_text_are_dropped():
    """An evaluation text (e.g. an essay of the long-context workloads) pasted into a reply removes that document;
    without the filter the same document is kept (the negative control)."""
    tok = tiny_chat_tokenizer()
    convs = conversations(30, seed=4)
    essay = paragraph(random.Random(9), 30)
    for c in convs:
        c[1]["content"] = essay + "\n\n" + c[1]["content"]
    rows, dropped = long_document_prompts(convs, tok, 10, min_tokens=60, max_tokens=150, seed=0,
                                          eval_filter=EvalFilter.from_texts([essay.upper()]))
    assert rows == [] and dropped["contaminated"] > 0
    kept, _ = long_document_prompts(convs, tok, 10, min_tokens=60, max_tokens=150, seed=0, eval_filter=None)
    assert len(kept) == 10 and all(r["prompt"].startswith(essay) for r in kept)


def test_eval_filter_reads_the_long_context_essays(tmp_path):
    folder = tmp_path / "long_context" / "paul_graham_essays"
    folder.mkdir(parents=True)
    text = "How to start a startup: the first thing you need is an idea that people want, and it helps to be young."
    (folder / "essay.txt").write_text(text)
    f = EvalFilter.from_data_dir(tmp_path)
    assert f.sources == {"long_context/paul_graham_essays": 1}
    assert f.matches("My notes.\n" + text.upper()) and not f.matches("an unrelated paragraph about birds and trees")


def test_cli_writes_prompts_regenerate_reads(tmp_path, capsys):
    target = save_tiny_chat_target(tmp_path / "target")
    dump = tmp_path / "sharegpt.json"
    dump.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in c]}
        for i, c in enumerate(conversations(40))]))
    out = tmp_path / "long.jsonl"
    assert main(["long-prompts", "--target", str(target), "--data", str(dump), "--n", "8", "--out", str(out),
                 "--min-tokens", "80", "--max-tokens", "160", "--eval-data", ""]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 8
    from anchorspec.data.regenerate import read_prompt_items

    items = read_prompt_items(str(out))
    assert [i.id for i in items] == [f"longdoc:0:{k}" for k in range(8)]
    assert main(["long-prompts", "--target", str(target), "--data", str(dump), "--n", "8", "--out", str(out),
                 "--min-tokens", "5000", "--max-tokens", "6000", "--eval-data", ""]) == 2
    assert "no conversation" in capsys.readouterr().err
