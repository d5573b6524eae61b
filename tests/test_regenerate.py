"""`anchorspec regenerate`: prompt readers, continuous-batching answers equal to one-prompt decoding
(greedy and seeded sampling), resume, the OpenAI-endpoint path against `anchorspec serve`, CLI errors.

A tiny random Llama (vocab 96) with a word-level ChatML tokenizer, saved to a directory; float64 so
greedy answers have no near ties and batched decoding must match one-prompt decoding token for token.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from anchorspec import cli
from anchorspec.data.regenerate import (AnswerRequest, ContinuousBatcher, PromptItem, done_ids, length_groups,
                                        prompt_seed,
                                        read_prompt_items, regenerate, regenerate_endpoint)
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
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


def test_a_prompt_rows_own_id_names_it_so_same_named_files_do_not_collide(tmp_path):
    """synth-prompts writes ids per seed and draw. Two runs' files of the same name must give different
    ids, or --skip-packed takes the second file's prompts for the first's, already answered (session
    34: 4,000 Magpie prompts of seed 33 skipped as packed seed-32 ones). Rows without an id keep
    name:index; an id that names two rows is refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_jsonl(a / "magpie-prompts.jsonl", [{"id": "magpie:32:0", "prompt": "x"}, {"id": "magpie:32:4", "prompt": "y"}])
    write_jsonl(b / "magpie-prompts.jsonl", [{"id": "magpie:33:1", "prompt": "z"}, {"prompt": "w"}])
    assert [it.id for it in read_prompt_items(str(a / "magpie-prompts.jsonl"))] == ["magpie:32:0", "magpie:32:4"]
    assert [it.id for it in read_prompt_items(str(b / "magpie-prompts.jsonl"))] == ["magpie:33:1", "magpie-prompts.jsonl:1"]
    arr = tmp_path / "own.json"
    arr.write_text(json.dumps([{"id": "q-7", "instruction": "do x"}]))
    assert [it.id for it in read_prompt_items(str(arr))] == ["q-7"]
    write_jsonl(tmp_path / "dup.jsonl", [{"id": "same", "prompt": "x"}, {"id": "same", "prompt": "y"}])
    with pytest.raises(AnchorspecError, match="names two prompts"):
        read_prompt_items(str(tmp_path / "dup.jsonl"))
    own = write_jsonl(tmp_path / "own.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(30)])
    subset = read_prompt_items(str(own), limit=5, seed=3)  # a seeded subset of rows with their own ids
    assert [it.id for it in subset] == sorted((it.id for it in subset), key=lambda s: int(s[1:]))  # file order
    assert all(it.messages[0]["content"] == "p" + it.id[1:] for it in subset)


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
    return load_target(str(target_dir), "float64")


@pytest.fixture(scope="module")
def items():
    """20 prompts of different lengths: some with a system prompt, some multi-turn (an earlier
    user/assistant exchange before the user turn to answer)."""
    out = []
    for i, conv in enumerate(tiny_conversations(20, seed=1)):
        msgs = conv[:1]
        if i % 5 == 2:
            msgs = [{"role": "system", "content": "w1 w2 w3"}] + msgs
        if i % 7 == 3:
            msgs = conv + [{"role": "user", "content": f"w{i} w{i + 1}"}]
        out.append(PromptItem(f"src:{i}", msgs))
    return out


def prompt_ids(target, item) -> list[int]:
    enc = target.tokenizer.apply_chat_template(item.messages, tokenize=True, add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def solo(target, item, sampling=SamplingParams(), seed=None, max_new=MAX_NEW) -> tuple[str, str, int]:
    """(reply, finish, new_tokens) of plain decoding of the single prompt, alone."""
    eos = target.tokenizer.eos_token_id
    res = generate_vanilla(target, torch.tensor(prompt_ids(target, item)),
                           GenerationConfig(max_new_tokens=max_new, sampling=sampling, seed=seed,
                                            stop_token_ids=(eos,)))
    toks = res.token_ids[:-1] if res.finish_reason == "stop" else res.token_ids
    return target.tokenizer.decode(toks, skip_special_tokens=True), res.finish_reason, len(toks)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def expected(target, items):
    return {it.id: solo(target, it) for it in items}


def check_records(recs, items, expected):
    """Every item answered exactly once, each record equal to the expected (reply, finish, new_tokens)."""
    assert sorted(r["id"] for r in recs) == sorted(it.id for it in items)
    by_id = {it.id: it for it in items}
    for r in recs:
        assert set(r) == {"id", "messages", "finish", "new_tokens"}
        reply, finish, n = expected[r["id"]]
        assert r["messages"][:-1] == by_id[r["id"]].messages
        assert r["messages"][-1] == {"role": "assistant", "content": reply}, r["id"]
        assert (r["finish"], r["new_tokens"]) == (finish, n), r["id"]


@pytest.fixture
def round_spy(monkeypatch):
    """Records (prefills, rows in the batched forward) of every BatchDecoder round."""
    rounds = []
    real = BatchDecoder.round

    def spy(self, items):
        result = real(self, items)
        rounds.append((result.prefills, result.rows))
        return result

    monkeypatch.setattr(BatchDecoder, "round", spy)
    return rounds


def test_greedy_answers_equal_plain_decoding(target, items, expected, tmp_path, round_spy):
    lengths = {len(prompt_ids(target, it)) for it in items}
    assert len(lengths) > 5  # precondition: prompts of many lengths
    out = tmp_path / "regen.jsonl"
    report = regenerate(target, items, out, max_new_tokens=MAX_NEW, batch_size=4, progress=False)
    assert report["answered"] == len(items) and report["skipped_done"] == 0
    recs = read_records(out)
    check_records(recs, items, expected)
    assert {r["finish"] for r in recs} == {"stop", "length"}  # both endings were exercised
    assert report["new_tokens"] == sum(r["new_tokens"] for r in recs)
    # Continuous batching: never more than 4 rows; new prompts prefilled while others were decoding
    # (a finished row replaced mid-way), not only at the start.
    assert max(rows for _, rows in round_spy) == 4
    assert sum(prefills for prefills, _ in round_spy) == len(items)
    assert sum(1 for prefills, rows in round_spy if prefills and rows) >= 3
    # Fewer rounds than one prompt at a time would need (prefill + MAX_NEW - 1 steps each at most).
    assert len(round_spy) < sum(r["new_tokens"] for r in recs) / 2


def test_length_groups_split_only_when_padding_costs_more_than_a_forward():
    lengths = [1300, 40, 870, 35, 30, 550]
    groups = length_groups(lengths, split_keys=1000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [sorted(lengths[i] for i in g) for g in groups] == [[550, 870, 1300], [30, 35, 40]]
    assert length_groups(lengths, split_keys=10**6) == [[0, 2, 5, 1, 3, 4]]  # one forward: longest first
    assert len(length_groups(lengths, split_keys=0)) == len(set(lengths))  # free forwards: no padding at all
    assert length_groups([]) == []


def test_split_rounds_equal_plain_decoding(target, items, expected, tmp_path, round_spy):
    """Rows of a round in several forwards (split_keys=1: any padding is worth a forward) give the same answers."""
    out = tmp_path / "split.jsonl"
    regenerate(target, items, out, max_new_tokens=MAX_NEW, batch_size=6, split_keys=1, progress=False)
    check_records(read_records(out), items, expected)
    assert any(0 < rows < 6 for _, rows in round_spy)  # the forwards really were split


def test_sampled_answers_are_seeded_per_prompt(target, items, tmp_path):
    sampled = dict(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, progress=False)
    a, b, c, d = (tmp_path / f"{n}.jsonl" for n in "abcd")
    regenerate(target, items, a, batch_size=4, seed=5, **sampled)
    regenerate(target, items, b, batch_size=4, seed=5, **sampled)
    regenerate(target, items, c, batch_size=4, seed=6, **sampled)
    regenerate(target, items, d, batch_size=7, seed=5, **sampled)  # other batches, same seeds per prompt
    assert a.read_text() == b.read_text()  # a rerun reproduces the file byte for byte
    by_id = {name: {r["id"]: r for r in read_records(path)} for name, path in zip("acd", (a, c, d))}
    assert by_id["a"] == by_id["d"]
    differ = sum(by_id["a"][k]["messages"][-1] != by_id["c"][k]["messages"][-1] for k in by_id["a"])
    assert differ >= len(items) // 2  # another seed, other answers
    # Each answer is the one-prompt sampled run with that prompt's seed (float64: no rounding differences).
    params = SamplingParams(1.0, 0.9)
    check_records(list(by_id["a"].values()), items,
                  {it.id: solo(target, it, params, prompt_seed(5, it.id)) for it in items})
    greedy = {it.id: solo(target, it) for it in items}
    assert sum(by_id["a"][k]["messages"][-1]["content"] != greedy[k][0] for k in greedy) >= len(items) // 2


def test_next_turn_added_while_running(target, items):
    """A caller can queue a conversation's next turn once its reply is known (turn-by-turn regeneration)."""
    tok = target.tokenizer
    batcher = ContinuousBatcher(target, batch_size=3, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    for it in items[:5]:
        batcher.add(AnswerRequest(it, prompt_ids(target, it)))
    replies, follow_ups = {}, {}
    for request, res in batcher.run():
        it = request.key
        toks = res.token_ids[:-1] if res.finish_reason == "stop" else res.token_ids
        replies[it.id] = tok.decode(toks, skip_special_tokens=True)
        if not it.id.endswith("/2"):
            nxt = PromptItem(it.id + "/2", it.messages + [{"role": "assistant", "content": replies[it.id]},
                                                          {"role": "user", "content": "w7 w8"}])
            batcher.add(AnswerRequest(nxt, prompt_ids(target, nxt)))
            follow_ups[nxt.id] = nxt
    assert len(replies) == 10
    for it in items[:5] + list(follow_ups.values()):
        assert replies[it.id] == solo(target, it, max_new=6)[0], it.id


def test_rerun_skips_done_and_partial_line_is_redone(target, items, expected, tmp_path):
    out = tmp_path / "regen.jsonl"
    kw = dict(max_new_tokens=MAX_NEW, batch_size=8, progress=False)
    regenerate(target, items, out, **kw)
    first = out.read_text()
    again = regenerate(target, items, out, **kw)
    assert again["answered"] == 0 and again["skipped_done"] == len(items)
    assert out.read_text() == first

    # A crash mid-write: the last record is cut in half (no trailing newline).
    lines = first.splitlines(keepends=True)
    lost = json.loads(lines[-1])["id"]
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert done_ids(out) == {json.loads(x)["id"] for x in lines[:-1]}
    assert out.read_text() == "".join(lines[:-1])  # the partial tail was cut off
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    redo = regenerate(target, items, out, **kw)
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
        regenerate(target, items, out, max_new_tokens=2, progress=False)
    assert out.read_text() == content  # nothing appended


def test_too_long_prompts_are_skipped(target, items, tmp_path):
    lengths = {it.id: len(prompt_ids(target, it)) for it in items}
    cap = sorted(lengths.values())[len(items) // 2]
    out = tmp_path / "short.jsonl"
    rep = regenerate(target, items, out, max_new_tokens=2, max_prompt_tokens=cap,
                     progress=False)
    kept = {i for i, n in lengths.items() if n <= cap}
    assert rep["skipped_too_long"] == len(items) - len(kept) > 0
    assert {r["id"] for r in read_records(out)} == kept


# --------------------------------------------------------------------------------------------
# regenerate_endpoint: an OpenAI-compatible server
# --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(target_dir):
    """`anchorspec serve` of the tiny target as a subprocess on a loopback port (plain decoding)."""
    pytest.importorskip("uvicorn")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorspec", "serve", "--target", str(target_dir), "--dtype",
                             "float64", "--threads", "1", "--host", "127.0.0.1", "--port", str(port), "--api-key",
                             "k3y", "--max-running", "3", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"anchorspec serve did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_endpoint_answers_equal_local_greedy(served, items, expected, tmp_path):
    out = tmp_path / "remote.jsonl"
    report = regenerate_endpoint(served, items, out, concurrency=3, api_key="k3y", max_new_tokens=MAX_NEW,
                                 progress=False)
    assert report["answered"] == len(items)
    recs = read_records(out)
    check_records(recs, items, expected)
    assert {r["finish"] for r in recs} == {"stop", "length"}
    # resumable as the local engine: a second run has nothing to do
    again = regenerate_endpoint(served + "/v1", items, out, concurrency=3, api_key="k3y", max_new_tokens=MAX_NEW,
                                progress=False)
    assert again["answered"] == 0 and again["skipped_done"] == len(items)


def test_endpoint_sampled_equals_local_sampled(served, target, items, tmp_path):
    """temperature, top_p and the per-prompt seed reach the server: its answers are the local engine's."""
    kw = dict(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=11, progress=False)
    regenerate_endpoint(served + "/v1/chat/completions", items[:8], tmp_path / "r.jsonl", concurrency=4,
                        api_key="k3y", **kw)
    regenerate(target, items[:8], tmp_path / "l.jsonl", batch_size=4, **kw)
    assert sorted(read_records(tmp_path / "r.jsonl"), key=lambda r: r["id"]) == \
        sorted(read_records(tmp_path / "l.jsonl"), key=lambda r: r["id"])


def test_endpoint_wrong_key_is_one_error(served, items, tmp_path):
    with pytest.raises(AnchorspecError, match="HTTP 401"):
        regenerate_endpoint(served, items, tmp_path / "x.jsonl", api_key="wrong", progress=False)


class FlakyServer(http.server.ThreadingHTTPServer):
    """A loopback OpenAI-style server that fails the first `failures` chat requests with 503."""

    def __init__(self, failures: int):
        self.failures, self.calls, self.bodies = failures, 0, []
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": "flaky-model", "object": "model"}]})

            def do_POST(inner):
                body = json.loads(inner.rfile.read(int(inner.headers["Content-Length"])))
                with lock:
                    self.calls += 1
                    failing = self.calls <= self.failures
                    self.bodies.append(body)
                if failing:
                    return inner.reply(503, {"error": {"message": "busy"}})
                text = "echo " + body["messages"][-1]["content"]
                inner.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_endpoint_retries_transient_errors_and_passes_settings(items, tmp_path):
    server = FlakyServer(failures=3)
    try:
        out = tmp_path / "flaky.jsonl"
        report = regenerate_endpoint(server.url, items[:4], out, concurrency=2, max_new_tokens=7, temperature=0.5,
                                     top_p=0.8, seed=3, backoff_s=0.01, progress=False)
        assert report["answered"] == 4 and server.calls == 4 + 3
        recs = {r["id"]: r for r in read_records(out)}
        for it in items[:4]:
            assert recs[it.id]["messages"][-1]["content"] == "echo " + it.messages[-1]["content"]
            assert (recs[it.id]["finish"], recs[it.id]["new_tokens"]) == ("stop", 4)  # 5 less the end-of-turn token
        sent = {json.dumps(b["messages"]): b for b in server.bodies}
        for it in items[:4]:
            body = sent[json.dumps(it.messages)]
            assert (body["model"], body["max_tokens"], body["temperature"], body["top_p"]) == ("flaky-model", 7, 0.5, 0.8)
            assert body["seed"] == prompt_seed(3, it.id)
        # a server that stays down: the job stops with one error after the retries, keeping what it wrote
        server.failures = 10**6
        with pytest.raises(AnchorspecError, match=r"HTTP 503.*gave up after 2 retries"):
            regenerate_endpoint(server.url, items[4:6], out, retries=2, backoff_s=0.01, progress=False)
        assert len(read_records(out)) == 4
    finally:
        server.shutdown()


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


@pytest.mark.parametrize("case", ["missing-data", "batch-size-0", "out-is-dir", "negative-limit", "bad-data-row",
                                  "bad-device", "cuda-without-gpu"])
def test_cli_bad_args_exit_2_one_line(capsys, tmp_path, target_dir, prompts_file, case):
    data, out, extra = prompts_file, tmp_path / "o.jsonl", []
    if case == "bad-device":
        extra = ["--device", "tpu"]
    elif case == "cuda-without-gpu":
        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA GPU")
        extra = ["--device", "cuda"]
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
              "negative-limit": "limit", "bad-data-row": "rows.jsonl:2", "bad-device": "--device must be",
              "cuda-without-gpu": "sees no CUDA GPU"}[case]
    assert expect in lines[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_argparse_error_is_one_line(capsys, target_dir, prompts_file):
    code = cli.main(["regenerate", "--target", str(target_dir), "--data", str(prompts_file), "--out", "x.jsonl",
                     "--batch-size", "many"])
    assert code == 2  # main() returns the exit code of an argparse error too
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
    items = read_prompt_items(str(prompts_file), limit=4, seed=7)
    ref = tmp_path / "api.jsonl"
    regenerate(t, items, ref, max_new_tokens=6, batch_size=3, seed=7, progress=False)
    assert sorted(out.read_text().splitlines()) == sorted(ref.read_text().splitlines())
    # A second CLI run has nothing left to do.
    code, stdout, _ = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", out,
                              "--dtype", "float32", "--max-new-tokens", 6, "--batch-size", 3,
                              "--limit-per-source", 4, "--seed", 7, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 0


@pytest.mark.parametrize("case", ["not-http", "nobody-listens", "no-target-no-endpoint"])
def test_cli_endpoint_errors_exit_2_one_line(capsys, tmp_path, prompts_file, case):
    endpoint = {"not-http": ["--endpoint", "localhost:8000/v1"],
                "nobody-listens": ["--endpoint", f"http://127.0.0.1:{free_port()}/v1"],
                "no-target-no-endpoint": []}[case]
    code, stdout, err = run_cli(capsys, "--data", prompts_file, "--out", tmp_path / "o.jsonl", *endpoint)
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorspec: error:"), err
    assert {"not-http": "not an http(s) URL", "nobody-listens": "cannot reach",
            "no-target-no-endpoint": "--endpoint"}[case] in lines[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_endpoint_matches_local(capsys, tmp_path, served, target, prompts_file):
    out = tmp_path / "cli-remote.jsonl"
    code, stdout, _ = run_cli(capsys, "--endpoint", served, "--concurrency", 2, "--api-key", "k3y", "--data",
                              prompts_file, "--out", out, "--max-new-tokens", 6, "--limit-per-source", 4, "--seed", 7)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 4
    ref = tmp_path / "local.jsonl"
    regenerate(target, read_prompt_items(str(prompts_file), limit=4, seed=7), ref, max_new_tokens=6, seed=7,
               progress=False)
    assert sorted(out.read_text().splitlines()) == sorted(ref.read_text().splitlines())


def test_cli_skip_packed_answers_only_prompts_the_corpus_lacks(capsys, tmp_path, target_dir, prompts_file):
    from anchorspec.data.corpus import write_part

    corpus = tmp_path / "corpus"
    write_part(corpus, [([1, 2, 3], [0, 1, 1])], vocab_size=100,
               provenance={"ids": [f"{prompts_file.name}:0", f"{prompts_file.name}:3"]})
    out = tmp_path / "o.jsonl"
    code, stdout, _ = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", out,
                              "--dtype", "float32", "--max-new-tokens", 2, "--skip-packed", corpus, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 4
    assert sorted(r["id"] for r in read_records(out)) == [f"{prompts_file.name}:{i}" for i in (1, 2, 4, 5)]
    code, _, err = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", out,
                           "--skip-packed", tmp_path)  # not a corpus: one line, nothing answered
    assert code == 2 and "not a corpus folder" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# every user turn (--turns all)
# --------------------------------------------------------------------------------------------

def test_turns_all_reads_later_user_turns(tmp_path):
    conv = [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"}, {"from": "human", "value": "q3"}]
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": conv}, {"conversations": conv[:2]}]))
    first, single = read_prompt_items(str(path), turns="all")
    assert first.messages == [{"role": "user", "content": "q1"}] and first.later_turns == ("q2", "q3")
    assert single.later_turns == ()
    assert [it.later_turns for it in read_prompt_items(str(path))] == [(), ()]  # the default: first turns only
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "u2"}]}])
    (it,) = read_prompt_items(str(chat), turns="all")
    assert it.messages[-1]["content"] == "u1" and it.later_turns == ("u2",)
    with pytest.raises(AnchorspecError, match="turns"):
        read_prompt_items(str(path), turns="some")


TURN_NEW = 32  # long enough that many replies end with <|im_end|> and a later turn follows


@pytest.fixture(scope="module")
def conversations():
    """Conversations of three user turns; the later turns are answered after the target's own replies."""
    convs = tiny_conversations(24, seed=4)
    return [PromptItem(f"conv:{i}", c[:1], (f"w{i} w3 w5", f"w{i + 2} w7"))
            for i, c in enumerate(convs)]


def expected_conversation(target, item, max_new, max_prompt, sampling=SamplingParams(), seed=0):
    """The reference: turn by turn, each one decoded alone with its own seed."""
    messages, total = item.messages, 0
    for index in range(len(item.later_turns) + 1):
        turn_seed = prompt_seed(seed, item.id if index == 0 else f"{item.id}#{index}")
        reply, finish, n = solo(target, PromptItem(item.id, messages), sampling, turn_seed, max_new)
        total += n
        if finish != "stop" or index == len(item.later_turns):
            break
        following = messages + [{"role": "assistant", "content": reply},
                                {"role": "user", "content": item.later_turns[index]}]
        if len(prompt_ids(target, PromptItem(item.id, following))) > max_prompt:
            break
        messages = following
    return {"messages": messages + [{"role": "assistant", "content": reply}], "finish": finish, "new_tokens": total}


@pytest.mark.parametrize("max_prompt", [1024, 36])
def test_turns_all_local_equals_turn_by_turn_solo(target, conversations, tmp_path, max_prompt):
    out = tmp_path / "multi.jsonl"
    report = regenerate(target, conversations, out, max_new_tokens=TURN_NEW, max_prompt_tokens=max_prompt,
                        batch_size=4, progress=False)
    recs = {r["id"]: r for r in read_records(out)}
    assert sorted(recs) == sorted(it.id for it in conversations)
    turns, budget_stops = [], 0
    for it in conversations:
        want = expected_conversation(target, it, TURN_NEW, max_prompt)
        got = recs[it.id]
        assert {k: got[k] for k in want} == want, it.id
        turns.append(sum(m["role"] == "assistant" for m in got["messages"]))
        budget_stops += got["finish"] == "stop" and turns[-1] < 3
    # the cases exist: conversations answered to the end, ones stopped by a cut-off reply, and with the
    # short prompt budget ones whose next turn no longer fits
    assert min(turns) < 3
    if max_prompt == 1024:
        assert max(turns) == 3 and budget_stops == 0
    else:
        assert max(turns) >= 2 and budget_stops > 0
    assert report["later_turns_answered"] == sum(turns) - len(conversations)
    again = regenerate(target, conversations, out, max_new_tokens=TURN_NEW, max_prompt_tokens=max_prompt,
                       batch_size=4, progress=False)
    assert again["answered"] == 0 and len(read_records(out)) == len(conversations)  # resumed: nothing redone


def test_turns_all_endpoint_equals_local(served, target, conversations, tmp_path):
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    regenerate(target, conversations[:6], local, max_new_tokens=MAX_NEW, batch_size=3, progress=False)
    regenerate_endpoint(served, conversations[:6], remote, concurrency=3, api_key="k3y", max_new_tokens=MAX_NEW,
                        tokenizer=target.tokenizer, progress=False)
    assert sorted(local.read_text().splitlines()) == sorted(remote.read_text().splitlines())


def test_duplicate_prompts_are_not_answered(capsys, tmp_path, target_dir):
    """Prompts whose user turns normalise alike (what pack-corpus drops) are answered once: the
    first in order, or none if an already answered or packed prompt has them."""
    from anchorspec.data.corpus import write_part
    from anchorspec.data.regenerate import PromptItem, unique_prompts

    def item(i, text, later=()):
        return PromptItem(f"s:{i}", [{"role": "user", "content": text}], later)

    items = [item(0, "Hello  World!"), item(1, "hello world"), item(2, "other"), item(3, "hello world", ("more",)),
             item(4, "Other.")]
    kept, dropped = unique_prompts(items)
    assert [it.id for it in kept] == ["s:0", "s:2", "s:3"] and dropped == 2  # later turns make s:3 differ
    kept, dropped = unique_prompts(items, {"s:2"})  # answered: kept (skipped downstream), its twin dropped
    assert [it.id for it in kept] == ["s:0", "s:2", "s:3"] and dropped == 2
    kept, dropped = unique_prompts(items, {"s:1"})
    assert [it.id for it in kept] == ["s:1", "s:2", "s:3"] and dropped == 2  # s:0 repeats the answered s:1

    data = write_jsonl(tmp_path / "dup.jsonl", [{"prompt": p} for p in ("w1 w2", "W1, w2!", "w3", "w1 w2", "w4")])
    corpus = tmp_path / "corpus"
    write_part(corpus, [([1, 2, 3], [0, 1, 1])], vocab_size=100, provenance={"ids": ["dup.jsonl:2"]})
    out = tmp_path / "o.jsonl"
    code, stdout, err = run_cli(capsys, "--target", target_dir, "--data", data, "--out", out, "--dtype", "float32",
                                "--max-new-tokens", 2, "--skip-packed", corpus, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 2
    assert sorted(r["id"] for r in read_records(out)) == ["dup.jsonl:0", "dup.jsonl:4"]
    assert "2 prompts skipped" in err


# --------------------------------------------------------------------------------------------
# continuing packed conversations (--turns later)
# --------------------------------------------------------------------------------------------

def test_turns_later_continues_after_the_packed_first_reply(target, target_dir, conversations, tmp_path, capsys):
    """The first turns are answered and packed; `--turns later` asks the later user turns after
    exactly those packed replies, and pack-corpus trains only on the new replies."""
    from anchorspec.data.chat import render_with_loss_mask
    from anchorspec.data.corpus import pack_answers, packed_conversations
    from anchorspec.data.regenerate import LATER, continue_conversations

    first_out, corpus = tmp_path / "first.jsonl", tmp_path / "corpus"
    regenerate(target, [PromptItem(it.id, it.messages) for it in conversations], first_out,
               max_new_tokens=TURN_NEW, batch_size=4, progress=False)
    pack_answers([str(first_out)], corpus, str(target_dir), eval_data=None)
    firsts = {r["id"]: r for r in read_records(first_out)}

    single = PromptItem("one:0", [{"role": "user", "content": "w1 w2"}])
    unpacked = PromptItem("new:0", [{"role": "user", "content": "w1 w2"}], ("w3",))
    cont = continue_conversations(conversations + [single, unpacked], corpus, target.tokenizer)
    assert (cont.single_turn, cont.not_packed, cont.mismatched) == (1, 1, 0)
    assert len(cont.items) == len(conversations)
    for it in cont.items:
        pid = it.id.removesuffix(LATER)
        assert it.id == pid + LATER and it.context_replies == 1
        assert it.messages[:-1] == firsts[pid]["messages"]  # the packed reply, as the target wrote it
        assert it.messages[-1]["role"] == "user"
    # negative control: a prompt that is not the packed one's does not continue its reply
    changed = PromptItem(conversations[1].id, [{"role": "user", "content": "w9 w9 w9"}], ("w3",))
    assert continue_conversations([changed], corpus, target.tokenizer).mismatched == 1

    later_out = tmp_path / "later.jsonl"
    report = regenerate(target, cont.items, later_out, max_new_tokens=TURN_NEW, batch_size=4, progress=False)
    recs = {r["id"]: r for r in read_records(later_out)}
    assert sorted(recs) == sorted(it.id for it in cont.items) and report["answered"] == len(cont.items)
    for it in cont.items:
        want = expected_conversation(target, it, TURN_NEW, 1024)  # turn by turn, each decoded alone
        assert {k: recs[it.id][k] for k in want} == want and recs[it.id]["context_replies"] == 1

    parts_before = len(list(corpus.glob("part-*.npz")))
    pack_answers([str(later_out)], corpus, str(target_dir), eval_data=None)
    assert len(list(corpus.glob("part-*.npz"))) == parts_before + 1
    packed = packed_conversations(corpus, set(recs))
    assert sorted(packed) == sorted(recs)
    for pid, (tokens, loss) in packed.items():
        ids, full = render_with_loss_mask(target.tokenizer, recs[pid]["messages"])
        first_ids, first_loss = render_with_loss_mask(target.tokenizer, firsts[pid.removesuffix(LATER)]["messages"])
        assert tokens == ids and tokens[:len(first_ids)] == first_ids
        assert loss[:len(first_ids)] == [0] * len(first_ids)  # the first reply is context here
        assert loss[len(first_ids):] == full[len(first_ids):] and sum(first_loss) > 0


def test_turns_later_needs_its_corpus(capsys, tmp_path, target_dir, prompts_file):
    code, _, err = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", tmp_path / "o.jsonl",
                           "--turns", "later")
    assert code == 2 and "--turns later and --continue-from CORPUS_DIR go together" in err
    code, _, err = run_cli(capsys, "--target", target_dir, "--data", prompts_file, "--out", tmp_path / "o.jsonl",
                           "--turns", "later", "--continue-from", tmp_path)
    assert code == 2 and "not a corpus folder" in err


def test_context_replies_mask_only_the_later_replies(target):
    from anchorspec.data.chat import render_with_loss_mask

    conv = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"},
            {"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5"}]
    ids, full = render_with_loss_mask(target.tokenizer, conv)
    ids2, later = render_with_loss_mask(target.tokenizer, conv, context_replies=1)
    cut = len(render_with_loss_mask(target.tokenizer, conv[:2])[0])
    assert ids2 == ids and later[:cut] == [0] * cut and later[cut:] == full[cut:]
    assert 0 < sum(later) < sum(full)
    assert sum(render_with_loss_mask(target.tokenizer, conv, context_replies=2)[1]) == 0
    with pytest.raises(AnchorspecError, match="context_replies 3"):
        render_with_loss_mask(target.tokenizer, conv, context_replies=3)


# --------------------------------------------------------------------------------------------
# a packed corpus as the prompt source (its prompts answered again)
# --------------------------------------------------------------------------------------------

def roundtrip_conversations(n: int, seed: int) -> list[PromptItem]:
    """Prompts over the round-trip tokenizer's words: plain, with a system prompt, with newlines, and
    later turns whose earlier reply is context (context_replies=1, as `--turns later` writes them)."""
    import random

    from helpers import CHAT_WORDS

    rng, words = random.Random(seed), CHAT_WORDS[:-2]

    def text(lo, hi, sep=" "):
        return sep.join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": text(2, 6) + ("\n" + text(1, 3) if i % 3 == 1 else "")}]
        if i % 4 == 2:
            msgs.insert(0, {"role": "system", "content": text(2, 4)})
        if i % 5 == 3:
            out.append(PromptItem(f"rt:{i}#later", msgs + [{"role": "assistant", "content": text(2, 5)},
                                                            {"role": "user", "content": text(1, 4)}],
                                  context_replies=1))
        else:
            out.append(PromptItem(f"rt:{i}", msgs))
    return out


@pytest.fixture(scope="module")
def rt_target_dir(tmp_path_factory):
    return save_tiny_chat_target(tmp_path_factory.mktemp("rt_target"), dtype=torch.float64, seed=1, roundtrip=True)


@pytest.fixture(scope="module")
def rt_corpus(rt_target_dir, tmp_path_factory):
    """Greedy answers to roundtrip_conversations, packed: the corpus whose prompts are answered again."""
    from anchorspec.data.corpus import pack_answers

    tmp = tmp_path_factory.mktemp("rt_corpus")
    target = load_target(str(rt_target_dir), "float64")
    items = roundtrip_conversations(12, seed=5)
    regenerate(target, items, tmp / "greedy.jsonl", max_new_tokens=MAX_NEW, batch_size=4, progress=False)
    pack_answers([str(tmp / "greedy.jsonl")], tmp / "corpus", str(rt_target_dir), eval_data=None)
    return target, items, tmp / "greedy.jsonl", tmp / "corpus"


def test_messages_from_prompt_reads_back_exactly_what_prompt_ids_encodes(rt_corpus):
    from anchorspec.data.chat import messages_from_prompt, prompt_ids as encode
    from helpers import tiny_chat_tokenizer

    target, items, _, _ = rt_corpus
    tok = target.tokenizer
    for it in items:
        ids = encode(tok, it.messages)
        assert messages_from_prompt(tok, ids) == it.messages, it.id
        assert messages_from_prompt(tok, ids[:-1]) is None  # not ready for a reply
        assert messages_from_prompt(tok, ids + encode(tok, items[0].messages)) is None  # two prompts glued
    # a tokenizer whose decode does not give the rendered text back: nothing is guessed
    plain = tiny_chat_tokenizer()
    assert messages_from_prompt(plain, encode(plain, [{"role": "user", "content": "w1 w2"}])) is None
    # a template not of the form open(role) + content + close: nothing is guessed
    odd = tiny_chat_tokenizer(roundtrip=True)
    odd.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert messages_from_prompt(odd, encode(odd, [{"role": "user", "content": "w1 w2"}])) is None


def test_corpus_prompts_answered_again_under_their_ids(rt_corpus, rt_target_dir, tmp_path):
    """Greedy answers to a corpus's own prompts are the packed answers again, token for token; sampled
    answers pack into a folder of their own with the same prompts and ids, later turns' context
    replies left untrained."""
    from anchorspec.data.chat import prompt_ids as encode
    from anchorspec.data.corpus import pack_answers, packed_conversations
    from anchorspec.data.regenerate import corpus_prompt_items

    target, items, greedy, corpus = rt_corpus
    got = corpus_prompt_items(corpus, target.tokenizer)
    assert (got.unreadable, got.no_answer) == (0, 0)
    by_id = {it.id: it for it in items}
    assert sorted(it.id for it in got.items) == sorted(by_id)
    for it in got.items:
        assert it.messages == by_id[it.id].messages and it.context_replies == by_id[it.id].context_replies
        assert list(it.prompt_ids) == encode(target.tokenizer, it.messages)

    again = tmp_path / "again.jsonl"
    regenerate(target, got.items, again, max_new_tokens=MAX_NEW, batch_size=4, progress=False)
    assert sorted(read_records(again), key=lambda r: r["id"]) == sorted(read_records(greedy), key=lambda r: r["id"])

    sampled = tmp_path / "t1.jsonl"
    regenerate(target, got.items, sampled, max_new_tokens=MAX_NEW, batch_size=4, temperature=1.0, seed=3,
               progress=False)
    recs = {r["id"]: r for r in read_records(sampled)}
    assert any(recs[i]["messages"][-1] != r["messages"][-1] for i, r in ((r["id"], r) for r in read_records(greedy)))
    pack_answers([str(sampled)], tmp_path / "t1", str(rt_target_dir), eval_data=None)
    twins, originals = packed_conversations(tmp_path / "t1", set(recs)), packed_conversations(corpus, set(recs))
    assert sorted(twins) == sorted(recs)
    for pid, (tokens, loss) in twins.items():
        start = loss.index(1)
        assert tokens[:start] == originals[pid][0][:originals[pid][1].index(1)]  # the same prompt, context untrained


def test_corpus_prompts_limit_and_unreadable_count(rt_corpus):
    from anchorspec.data.regenerate import corpus_prompt_items
    from helpers import tiny_chat_tokenizer

    target, items, _, corpus = rt_corpus
    a = corpus_prompt_items(corpus, target.tokenizer, limit=5, seed=1)
    assert len(a.items) == 5 and [it.id for it in a.items] == [it.id for it in
                                                               corpus_prompt_items(corpus, target.tokenizer, 5, 1).items]
    assert {it.id for it in a.items} != {it.id for it in corpus_prompt_items(corpus, target.tokenizer, 5, 2).items}
    with pytest.raises(AnchorspecError, match="none of its 12 prompts reads back"):
        corpus_prompt_items(corpus, tiny_chat_tokenizer())  # another tokenizer's ids


def test_cli_regenerates_a_corpus_s_prompts(capsys, rt_corpus, rt_target_dir, tmp_path):
    _, items, greedy, corpus = rt_corpus
    out = tmp_path / "o.jsonl"
    code, stdout, _ = run_cli(capsys, "--target", rt_target_dir, "--data", corpus, "--out", out, "--dtype", "float64",
                              "--max-new-tokens", MAX_NEW, "--batch-size", 4, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == len(items)
    assert sorted(out.read_text().splitlines()) == sorted(greedy.read_text().splitlines())
    code, stdout, _ = run_cli(capsys, "--target", rt_target_dir, "--data", corpus, "--out", tmp_path / "s.jsonl",
                              "--dtype", "float64", "--max-new-tokens", 2, "--skip-packed", corpus, "--threads", 1)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["answered"] == 0  # all answered there
    code, _, err = run_cli(capsys, "--target", rt_target_dir, "--data", corpus, "--out", tmp_path / "x.jsonl",
                           "--turns", "all")
    assert code == 2 and "--turns must be first" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "--endpoint", "http://127.0.0.1:9/v1", "--data", corpus, "--out",
                           tmp_path / "y.jsonl")
    assert code == 2 and "--target is needed" in err and len(err.strip().splitlines()) == 1


def test_prompt_ids_equal_apply_chat_template(target, items, rt_corpus):
    """chat.prompt_ids renders and encodes itself (the two steps messages_from_prompt checks with); it must
    give apply_chat_template's ids."""
    from anchorspec.data.chat import prompt_ids as encode

    rt_target, rt_items, _, _ = rt_corpus
    for tgt, its in ((target, items), (rt_target, rt_items)):
        for it in its:
            assert encode(tgt.tokenizer, it.messages) == prompt_ids(tgt, it), it.id
