"""`anchorspec regenerate`: prompt readers, batched greedy answers equal to plain decoding, resume, CLI errors.

A tiny random Llama (vocab 96) with a word-level ChatML tokenizer, saved to a directory; float64 so
greedy answers have no near ties and batched (left-padded) decoding must match one-prompt decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anchorspec import cli
from anchorspec.data.regenerate import PromptItem, _batches, done_ids, read_prompt_items, regenerate
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.errors import AnchorspecError
from anchorspec.models.target import load_target

from helpers import save_tiny_chat_target, tiny_conversations

MAX_NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------
# read_prompt_items
# --------------------------------------------------------------------------------------------

def test_sharegpt_first_user_turn_with_system_and_row_ids(tmp_path):
    rows = [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q0"},
                           {"from": "gpt", "value": "a0"}, {"from": "human", "value": "q0b"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn first"}]},  # unusable: dropped
        {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(rows, indent=1))
    items = read_prompt_items(str(path))
    # Ids are the array index: the dropped element does not shift the id of the one after it.
    assert [it.id for it in items] == ["share.json:0", "share.json:2"]
    assert items[0].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"}]
    assert items[1].messages == [{"role": "user", "content": "q2"}]
    assert [it.id for it in read_prompt_items(str(path))] == [it.id for it in items]  # stable


def test_messages_jsonl_up_to_first_user_turn(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]},
        {"messages": [{"role": "user", "content": "only"}]},
    ])
    items = read_prompt_items(str(path))
    assert [it.id for it in items] == ["chat.jsonl:0", "chat.jsonl:1"]
    assert items[0].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"}]
    assert items[1].messages == [{"role": "user", "content": "only"}]


def test_mtbench_turns_first_turn(tmp_path):
    path = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 81, "turns": ["first", "second"]},
                                               {"question_id": 82, "turns": ["another"]}])
    items = read_prompt_items(str(path))
    assert [(it.id, it.messages) for it in items] == [
        ("mt.jsonl:0", [{"role": "user", "content": "first"}]),
        ("mt.jsonl:1", [{"role": "user", "content": "another"}])]


def test_instruction_json_array_and_question_jsonl(tmp_path):
    arr = tmp_path / "alpaca.json"
    arr.write_text(json.dumps([{"instruction": "do x", "output": "ignored"}, {"instruction": "do y"}]))
    assert [(it.id, it.messages) for it in read_prompt_items(str(arr))] == [
        ("alpaca.json:0", [{"role": "user", "content": "do x"}]),
        ("alpaca.json:1", [{"role": "user", "content": "do y"}])]
    q = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}])
    assert [(it.id, it.messages) for it in read_prompt_items(str(q))] == [
        ("gsm.jsonl:0", [{"role": "user", "content": "1+1?"}]),
        ("gsm.jsonl:1", [{"role": "user", "content": "2+2?"}])]


def test_limit_is_a_seeded_reproducible_subset(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(30)])
    full = read_prompt_items(str(path))
    a = read_prompt_items(str(path), limit=5, seed=3)
    b = read_prompt_items(str(path), limit=5, seed=3)
    c = read_prompt_items(str(path), limit=5, seed=4)
    ids = [it.id for it in a]
    assert len(a) == 5 and ids == [it.id for it in b]
    assert ids != [it.id for it in c]  # another seed, another subset (C(30,5) choices)
    assert set(ids) <= {it.id for it in full}
    assert ids == sorted(ids, key=lambda s: int(s.rsplit(":", 1)[1]))  # kept in file order
    for it in a:  # an id still names its own row
        assert it.messages == [{"role": "user", "content": f"p{it.id.rsplit(':', 1)[1]}"}]
    assert [it.id for it in read_prompt_items(str(path), limit=100)] == [it.id for it in full]
    with pytest.raises(AnchorspecError, match="limit"):
        read_prompt_items(str(path), limit=0)


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_row_without_prompt_names_file_and_line(tmp_path, kind):
    rows = [{"prompt": "fine"}, {"text": "no usable field"}]
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "bad.jsonl", rows)
    else:
        path = tmp_path / "bad.json"
        path.write_text("[\n" + json.dumps(rows[0]) + ",\n" + json.dumps(rows[1]) + "\n]\n")  # row 1 on line 3
    line = 2 if kind == "jsonl" else 3
    with pytest.raises(AnchorspecError, match=rf"bad\.{kind}:{line}\b"):
        read_prompt_items(str(path))


def test_bad_messages_row_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "ok"}]},
                                              {"messages": [{"content": "no role"}]}])
    with pytest.raises(AnchorspecError, match=r"m\.jsonl:2\b"):
        read_prompt_items(str(path))
    path = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "assistant", "content": "no user"}]}])
    with pytest.raises(AnchorspecError, match=r"n\.jsonl:1\b.*no user turn"):
        read_prompt_items(str(path))


# --------------------------------------------------------------------------------------------
# regenerate()
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # seed 1: with these prompts some greedy answers end with <|im_end|> and some run to the budget.
    return save_tiny_chat_target(tmp_path_factory.mktemp("chat_target"), dtype=torch.float64, seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    t = load_target(str(target_dir), "float64")
    t.tokenizer.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def items():
    out = []
    for i, conv in enumerate(tiny_conversations(20, seed=1)):
        msgs = conv[:1]
        if i % 5 == 2:
            msgs = [{"role": "system", "content": "w1 w2 w3"}] + msgs
        out.append(PromptItem(f"src:{i}", msgs))
    return out


def prompt_ids(target, item) -> list[int]:
    enc = target.tokenizer.apply_chat_template(item.messages, tokenize=True, add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def reference(target, item) -> tuple[str, str, int]:
    """(reply, finish, new_tokens) of plain greedy decoding of the single unpadded prompt."""
    eos = target.tokenizer.eos_token_id
    res = generate_vanilla(target, torch.tensor(prompt_ids(target, item)),
                           GenerationConfig(max_new_tokens=MAX_NEW, stop_token_ids=(eos,)))
    toks = res.token_ids[:-1] if res.finish_reason == "stop" else res.token_ids
    return target.tokenizer.decode(toks, skip_special_tokens=True), res.finish_reason, len(toks)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def expected(target, items):
    return {it.id: reference(target, it) for it in items}


def test_batches_mix_lengths(target, items):
    """Precondition of the padding test: batches of 4 hold prompts of different lengths."""
    lengths = [len(prompt_ids(target, it)) for it in items]
    batches = list(_batches(lengths, 4, 16384))
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    assert any(len({lengths[i] for i in b}) > 1 for b in batches)


def test_greedy_answers_equal_plain_decoding(target, items, expected, tmp_path):
    out = tmp_path / "regen.jsonl"
    report = regenerate(target.model, target.tokenizer, items, out, max_new_tokens=MAX_NEW, batch_size=4,
                        progress=False)
    assert report["answered"] == len(items) and report["skipped_done"] == 0
    recs = read_records(out)
    assert sorted(r["id"] for r in recs) == sorted(it.id for it in items)  # every prompt exactly once
    by_id = {it.id: it for it in items}
    finishes = set()
    for r in recs:
        assert set(r) == {"id", "messages", "finish", "new_tokens"}
        reply, finish, n = expected[r["id"]]
        assert r["messages"][:-1] == by_id[r["id"]].messages
        assert r["messages"][-1] == {"role": "assistant", "content": reply}, r["id"]
        assert (r["finish"], r["new_tokens"]) == (finish, n), r["id"]
        finishes.add(r["finish"])
    assert finishes == {"stop", "length"}  # both endings were exercised
    assert report["new_tokens"] == sum(r["new_tokens"] for r in recs)


def test_rerun_skips_done_and_partial_line_is_redone(target, items, expected, tmp_path):
    out = tmp_path / "regen.jsonl"
    kw = dict(max_new_tokens=MAX_NEW, batch_size=8, progress=False)
    regenerate(target.model, target.tokenizer, items, out, **kw)
    first = out.read_text()
    again = regenerate(target.model, target.tokenizer, items, out, **kw)
    assert again["answered"] == 0 and again["skipped_done"] == len(items)
    assert out.read_text() == first

    # A crash mid-write: the last record is cut in half (no trailing newline).
    lines = first.splitlines(keepends=True)
    lost = json.loads(lines[-1])["id"]
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert done_ids(out) == {json.loads(x)["id"] for x in lines[:-1]}
    assert out.read_text() == "".join(lines[:-1])  # the partial tail was cut off
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    redo = regenerate(target.model, target.tokenizer, items, out, **kw)
    assert redo["answered"] == 1 and redo["skipped_done"] == len(items) - 1
    recs = read_records(out)  # every line is whole JSON again
    assert sorted(r["id"] for r in recs) == sorted(it.id for it in items)
    assert recs[-1]["id"] == lost
    assert recs[-1]["messages"][-1]["content"] == expected[lost][0]


@pytest.mark.parametrize("content", ['{"foo": 1}\n', "not json at all\n", '["a list"]\n'])
def test_foreign_output_file_raises(target, items, tmp_path, content):
    out = tmp_path / "other.jsonl"
    out.write_text(content)
    with pytest.raises(AnchorspecError, match=r"other\.jsonl:1: not a regenerate record"):
        regenerate(target.model, target.tokenizer, items, out, max_new_tokens=2, progress=False)
    assert out.read_text() == content  # nothing appended


def test_too_long_prompts_are_skipped(target, items, tmp_path):
    lengths = {it.id: len(prompt_ids(target, it)) for it in items}
    cap = sorted(lengths.values())[len(items) // 2]
    out = tmp_path / "short.jsonl"
    rep = regenerate(target.model, target.tokenizer, items, out, max_new_tokens=2, max_prompt_tokens=cap,
                     progress=False)
    kept = {i for i, n in lengths.items() if n <= cap}
    assert rep["skipped_too_long"] == len(items) - len(kept) > 0
    assert {r["id"] for r in read_records(out)} == kept


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["regenerate", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.fixture
def prompts_file(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": " ".join(f"w{j}" for j in range(i + 1))}
                                                    for i in range(6)])


@pytest.mark.parametrize("case", ["missing-data", "batch-size-0", "out-is-dir", "negative-limit", "bad-data-row"])
def test_cli_bad_args_exit_2_one_line(capsys, tmp_path, target_dir, prompts_file, case):
    data, out, extra = prompts_file, tmp_path / "o.jsonl", []
    if case == "missing-data":
        data = tmp_path / "missing.jsonl"
    elif case == "batch-size-0":
        extra = ["--batch-size", "0"]
    elif case == "out-is-dir":
        out = tmp_path / "outdir"
        out.mkdir()
    elif case == "negative-limit":
        extra = ["--limit-per-source", "-1"]
    elif case == "bad-data-row":
        data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "w1"}, {"nothing": 1}])
    code, stdout, err = run_cli(capsys, "--target", target_dir, "--data", data, "--out", out, *extra)
    assert code == 2
    assert stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorspec: error:"), err
    expect = {"missing-data": "missing.jsonl", "batch-size-0": "--batch-size", "out-is-dir": "directory",
              "negative-limit": "limit", "bad-data-row": "rows.jsonl:2"}[case]
    assert expect in lines[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_argparse_error_is_one_line(capsys, target_dir, prompts_file):
    with pytest.raises(SystemExit) as exc:
        cli.main(["regenerate", "--target", str(target_dir), "--data", str(prompts_file), "--out", "x.jsonl",
                  "--batch-size", "many"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_matches_api(capsys, tmp_path, target_dir, prompts_file):
    out = tmp_path / "cli.jsonl"
    code, stdout, _ = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", out,
                              "--dtype", "float32", "--max-new-tokens", 6, "--batch-size", 3,
                              "--limit-per-source", 4, "--seed", 7, "--threads", 1)
    assert code == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["answered"] == 4 and summary["out"] == str(out)
    t = load_target(str(target_dir), "float32")
    t.tokenizer.padding_side = "left"
    items = read_prompt_items(str(prompts_file), limit=4, seed=7)
    ref = tmp_path / "api.jsonl"
    regenerate(t.model, t.tokenizer, items, ref, max_new_tokens=6, batch_size=3, seed=7, progress=False)
    assert sorted(out.read_text().splitlines()) == sorted(ref.read_text().splitlines())
    # A second CLI run has nothing left to do.
    code, stdout, _ = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", out,
                              "--dtype", "float32", "--max-new-tokens", 6, "--batch-size", 3,
                              "--limit-per-source", 4, "--seed", 7, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 0
