"""Magpie prompts (`synth-prompts`) on the continuous-batching rounds: each draw is the query a solo sampled
decode with that draw's seed writes, different --seed values never re-draw each other's queries, a resumed
file equals an uninterrupted one, and the filters drop what they should. A tiny random float64 Llama with
a word-level ChatML tokenizer samples the queries."""

from __future__ import annotations

import json

import pytest
import torch

from anchorspec.data.magpie import draw_seed, synthesize_prompts, user_turn_prefix
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.sampling import SamplingParams
from anchorspec.errors import AnchorspecError
from anchorspec.models.target import load_target
from helpers import save_tiny_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 12  # the tiny target ends a query with <|im_end|> within this about half the time


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(str(save_tiny_chat_target(tmp_path_factory.mktemp("magpie_target"), seed=2)), "float64")


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _prompts(path):
    return [r["prompt"] for r in _rows(path)]


def synth(target, path, n, **kw):
    return synthesize_prompts(target, path, n, max_new_tokens=MAX_NEW, min_words=2, progress=False,
                              **{"batch_size": 4, **kw})


def test_each_draw_is_its_solo_sampled_query(target, tmp_path):
    out = tmp_path / "q.jsonl"
    report = synth(target, out, 6, seed=3)
    assert report["dropped"]["unfinished"] + report["dropped"]["short"] > 0  # the filters ran on real drops
    tok = target.tokenizer
    prefix = torch.tensor(tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"])
    for row in _rows(out):
        res = generate_vanilla(target, prefix, GenerationConfig(
            max_new_tokens=MAX_NEW, sampling=SamplingParams(1.0, 1.0), seed=draw_seed(3, row["draw"]),
            stop_token_ids=(tok.eos_token_id,)))
        assert res.finish_reason == "stop"
        assert row["prompt"] == tok.decode(res.token_ids[:-1], skip_special_tokens=True).strip()
        assert row["id"] == f"magpie:3:{row['draw']}"
    assert [r["draw"] for r in _rows(out)] == sorted(r["draw"] for r in _rows(out))  # written in draw order


def test_different_seeds_share_no_draw(target, tmp_path):
    assert {draw_seed(23, k) for k in range(10_000)}.isdisjoint({draw_seed(26, k) for k in range(10_000)})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    synth(target, a, 12, seed=23)
    synth(target, b, 12, seed=26)
    assert len(set(_prompts(a)) & set(_prompts(b))) < 3


def test_a_resumed_file_equals_an_uninterrupted_one(target, tmp_path):
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    synth(target, whole, 14, seed=5, batch_size=5)
    synth(target, parts, 6, seed=5, batch_size=3)  # another batch size: the same draws
    with open(parts, "a") as f:
        f.write('{"id": "magpie:5:99", "pro')  # a line cut off by a crash is dropped and redone
    report = synth(target, parts, 14, seed=5, batch_size=5)
    assert _prompts(parts) == _prompts(whole) and report["prompts"] == 14
    assert len(set(_prompts(whole))) == len(_prompts(whole))  # duplicates are dropped
    assert all(len(p.split()) >= 2 for p in _prompts(whole))  # so are queries under min_words
    assert user_turn_prefix(target.tokenizer) and "<|im_start|>user" in user_turn_prefix(target.tokenizer)


def test_a_file_of_the_older_batch_format_is_refused(target, tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"id": "magpie:0:0", "prompt": "w1 w2 w3", "batch": 0}) + "\n")
    with pytest.raises(AnchorspecError, match="older synth-prompts"):
        synth(target, old, 4)


def test_shared_prefix_skips_the_prefills_and_changes_no_query(target, tmp_path, monkeypatch):
    """With the shared prefix (the default) no draw prefills: each starts from the prefix's rows and its
    first token rides a batched round. The file is the one the per-draw prefills write."""
    from anchorspec.decode.engine import SpeculativeDecoding

    prefills = []
    real = SpeculativeDecoding._prefill
    monkeypatch.setattr(SpeculativeDecoding, "_prefill", lambda self: prefills.append(1) or real(self))
    alone, shared = tmp_path / "alone.jsonl", tmp_path / "shared.jsonl"
    synth(target, alone, 8, seed=7, shared_prefix=False)
    assert len(prefills) >= 8  # negative control: the old path prefills every draw
    prefills.clear()
    synth(target, shared, 8, seed=7)
    assert prefills == [] and _prompts(shared) == _prompts(alone)


def test_a_system_prompt_steers_the_queries_and_is_kept_apart(target, tmp_path):
    """--system: each draw is the query sampled after that system prompt (not the default one), ids carry
    the prompt's hash so they never collide with an unsteered file's, and a resume under another system
    prompt is refused."""
    tok, steer = target.tokenizer, "w7 w8 w9"
    assert user_turn_prefix(tok, steer) != user_turn_prefix(tok) and steer in user_turn_prefix(tok, steer)
    out = tmp_path / "s.jsonl"
    synth(target, out, 4, seed=3, system=steer)
    prefix = torch.tensor(tok(user_turn_prefix(tok, steer), add_special_tokens=False)["input_ids"])
    for row in _rows(out):
        res = generate_vanilla(target, prefix, GenerationConfig(
            max_new_tokens=MAX_NEW, sampling=SamplingParams(1.0, 1.0), seed=draw_seed(3, row["draw"]),
            stop_token_ids=(tok.eos_token_id,)))
        assert row["prompt"] == tok.decode(res.token_ids[:-1], skip_special_tokens=True).strip()
        assert row["id"].startswith("magpie-") and row["id"].endswith(f":3:{row['draw']}") and row["system"] == steer
    plain = tmp_path / "p.jsonl"
    synth(target, plain, 4, seed=3)
    assert {r["id"] for r in _rows(plain)}.isdisjoint(r["id"] for r in _rows(out))
    with pytest.raises(AnchorspecError, match="system prompt"):
        synth(target, out, 6, seed=3)
    with pytest.raises(AnchorspecError, match="system prompt"):
        synth(target, plain, 6, seed=3, system=steer)
