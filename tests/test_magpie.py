"""Magpie prompts (`synth-prompts`): batches seeded so that different --seed values never re-draw each
other's batches, a resumed file equals an uninterrupted one, and the filters drop what they should."""

from __future__ import annotations

import json

import torch

from anchorspec.data.magpie import batch_seed, synthesize_prompts, user_turn_prefix
from test_train import WORDS, make_tokenizer


class SeededSampler(torch.nn.Module):
    """Stands in for the target's `generate`: each row is a few words drawn from torch's global RNG (which
    synthesize_prompts seeds per batch), then the end of the turn."""

    def __init__(self, tokenizer, eot):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.word_ids = tokenizer.convert_tokens_to_ids(WORDS)
        self.eot = eot

    def generate(self, input_ids, max_new_tokens, **kw):
        rows = []
        for _ in range(input_ids.shape[0]):
            n = int(torch.randint(2, 7, ()))
            picks = torch.randint(len(self.word_ids), (n,)).tolist()
            rows.append([self.word_ids[i] for i in picks] + [self.eot])
        width = max(len(r) for r in rows)
        body = torch.tensor([r + [self.eot] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, body], dim=1)


def _prompts(path):
    return [json.loads(x)["prompt"] for x in path.read_text().splitlines()]


def test_different_seeds_share_no_batch(tmp_path):
    assert {batch_seed(23, k) for k in range(10_000)}.isdisjoint({batch_seed(26, k) for k in range(10_000)})
    tok = make_tokenizer()
    model = SeededSampler(tok, tok.eos_token_id)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    synthesize_prompts(model, tok, a, 60, batch_size=8, seed=23, progress=False)
    synthesize_prompts(model, tok, b, 60, batch_size=8, seed=26, progress=False)
    # with `seed + k` the seed-26 file would repeat the seed-23 file from its 4th batch on
    assert len(set(_prompts(a)) & set(_prompts(b))) < 5


def test_a_resumed_file_equals_an_uninterrupted_one(tmp_path):
    tok = make_tokenizer()
    model = SeededSampler(tok, tok.eos_token_id)
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    synthesize_prompts(model, tok, whole, 40, batch_size=8, seed=5, progress=False)
    synthesize_prompts(model, tok, parts, 20, batch_size=8, seed=5, progress=False)
    with open(parts, "a") as f:
        f.write('{"id": "magpie:5:99", "pro')  # a line cut off by a crash is dropped and redone
    report = synthesize_prompts(model, tok, parts, 40, batch_size=8, seed=5, progress=False)
    assert _prompts(parts) == _prompts(whole) and report["prompts"] >= 40
    assert len(set(_prompts(whole))) == len(_prompts(whole))  # duplicates are dropped
    assert all(len(p.split()) >= 3 for p in _prompts(whole))  # so are queries under min_words
    assert user_turn_prefix(tok) and "<|im_start|>user" in user_turn_prefix(tok)
