"""Training options through the trainer and the CLI: `--draft-layers N` (issue 15: a multi-layer drafter trains,
resumes exactly, continues with --init-from, is written with num_hidden_layers) and `--join-to` (issue 12: long
multi-turn sequences chained from short conversations)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from anchorspec.cli import main
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import KVCache, load_drafter
from anchorspec.train.trainer import Trainer
from train_world import DRAFT_VOCAB, config, drafter_state, read_jsonl, run_interrupted, setup  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_layer_drafter_trains_and_resumes_exactly(setup, tmp_path, monkeypatch):  # noqa: F811
    kw = dict(max_steps=4, save_every=2, draft_layers=2)
    a_out, b_out = tmp_path / "a", tmp_path / "b"
    a = Trainer(config(setup, a_out, **kw))
    assert len(a.drafter.decoder_layers) == 2
    a.run()
    losses = [r["loss"] for r in read_jsonl(a_out / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]  # it learns
    d = load_drafter(a_out / "final")
    assert d.config.num_hidden_layers == 2
    assert json.loads((a_out / "final" / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((a_out / "run.json").read_text())["config"]["draft_layers"] == 2

    cfg_b = config(setup, b_out, **kw)
    run_interrupted(cfg_b, monkeypatch, at_step=3)
    Trainer(dataclasses.replace(cfg_b, resume=True)).run()
    sa, sb = drafter_state(a_out / "final"), drafter_state(b_out / "final")
    assert sa.keys() == sb.keys() and any(k.startswith("layers.1.") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    with pytest.raises(AnchorspecError, match="draft_layers"):
        Trainer(dataclasses.replace(cfg_b, resume=True, draft_layers=1)).run()


def test_init_from_keeps_the_layer_count(setup, tmp_path):  # noqa: F811
    first = tmp_path / "first"
    Trainer(config(setup, first, max_steps=1, draft_layers=2)).run()
    cont = Trainer(config(setup, tmp_path / "cont", max_steps=1, init_from=str(first / "final"), variant=None,
                          draft_vocab_size=None, draft_layers=None))
    assert cont.cfg.draft_layers == 2 and len(cont.drafter.decoder_layers) == 2
    with pytest.raises(AnchorspecError, match="2 decoder layers; --draft-layers can add layers, not remove"):
        Trainer(config(setup, tmp_path / "bad", max_steps=1, init_from=str(first / "final"), variant=None,
                       draft_vocab_size=None, draft_layers=1))


def test_init_from_with_more_layers_grows_a_drafter_that_starts_unchanged(setup, tmp_path):  # noqa: F811
    """--draft-layers 3 on a 1-layer drafter: the grown drafter computes exactly what the trained one
    did (new layers start as the identity), then training moves every new layer."""
    first = tmp_path / "first"
    Trainer(config(setup, first, max_steps=2)).run()
    kw = dict(init_from=str(first / "final"), variant=None, draft_vocab_size=None, draft_layers=3)
    grown = Trainer(config(setup, tmp_path / "grown", max_steps=3, **kw))
    assert grown.cfg.draft_layers == 3 and len(grown.drafter.decoder_layers) == 3
    original = load_drafter(first / "final", grown.drafter.fc.weight.dtype)
    original.bind_target_embedding(grown.target.embed_weight.detach())
    tokens, positions = torch.tensor([[5, 9, 2, 7]]), torch.arange(4)[None]
    x = torch.randn(1, 4, original.config.hidden_size, dtype=original.fc.weight.dtype)
    before = original.step(tokens, x, positions, KVCache())
    after = grown.drafter.step(tokens, x, positions, KVCache())
    assert torch.equal(before.logits, after.logits) and torch.equal(before.next_hidden, after.next_hidden)
    start = {k: v.clone() for k, v in grown.drafter.state_dict().items() if k.startswith("deep_layers.")}
    grown.run()
    trained = load_drafter(tmp_path / "grown" / "final")
    assert trained.config.num_hidden_layers == 3
    for i in (0, 1):  # every new layer's zero projections moved, so both its branches now contribute
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert start[f"deep_layers.{i}.{name}"].abs().sum() == 0
            assert trained.deep_layers[i].state_dict()[name].abs().sum() > 0


def test_old_run_json_without_draft_layers_resumes(setup, tmp_path):  # noqa: F811
    """A run started before --draft-layers existed (no such key in run.json) still resumes."""
    out = tmp_path / "old"
    cfg = config(setup, out, max_steps=2, save_every=1)
    Trainer(cfg).run()
    run = json.loads((out / "run.json").read_text())
    del run["config"]["draft_layers"]
    (out / "run.json").write_text(json.dumps(run))
    Trainer(dataclasses.replace(cfg, resume=True, max_steps=2))._check_resume_config()


def test_cli_draft_layers(setup, tmp_path, capsys):  # noqa: F811
    target_dir, data = setup
    assert main(["init-drafter", "--target", str(target_dir), "--out", str(tmp_path / "d"), "--draft-layers", "3"]) == 0
    assert "3 decoder layers" in capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 3
    out = tmp_path / "run"
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--max-steps", "1",
                 "--ttt-steps", "2", "--draft-vocab-size", str(DRAFT_VOCAB), "--max-len", "64", "--batch-tokens",
                 "64", "--dtype", "float32", "--eval-prompts", "0", "--no-progress", "--draft-layers", "2"]) == 0
    assert load_drafter(out / "final").config.num_hidden_layers == 2
    assert main(["init-drafter", "--target", str(target_dir), "--out", str(tmp_path / "e"), "--draft-layers", "0"]) == 2
    assert "--draft-layers must be >= 1" in capsys.readouterr().err


def test_order_seed_changes_the_batch_order_not_the_heldout_split(setup, tmp_path):  # noqa: F811
    """`train --order-seed`: a continued round on the same corpus draws a new batch order (instead of
    replaying the previous round's first batches) while the held-out examples, keyed by --seed, stay out."""
    a = Trainer(config(setup, tmp_path / "a"))
    b = Trainer(config(setup, tmp_path / "b", order_seed=7))
    assert a.held_idx == b.held_idx
    first = [a.stream.get(i) for i in range(a.stream.per_epoch(0))]
    other = [b.stream.get(i) for i in range(b.stream.per_epoch(0))]
    assert first != other
    assert sorted(j for batch in first for j in batch) == sorted(j for batch in other for j in batch)  # one epoch each
    a.run()
    with pytest.raises(AnchorspecError, match="order_seed"):  # the order is the trajectory: --resume keeps it
        Trainer(dataclasses.replace(config(setup, tmp_path / "a"), resume=True, order_seed=7)).run()


def test_join_examples_chains_a_share_and_keeps_every_token_and_mask():
    """`--join-to`: the chained sequences are the chosen examples end to end (ids and loss masks in step), none
    longer than the limit unless one example alone is; the rest stay as they were; nothing is lost or repeated."""
    from anchorspec.train.dataset import Example, join_examples

    rng = random.Random(0)
    examples = []
    for k in range(40):
        n = rng.randint(5, 30)
        examples.append(Example([k * 100 + j for j in range(n)], [int(j >= n // 2) for j in range(n)]))
    out = join_examples(examples, 64, 0.5, seed=3)
    joined, alone = out[: len(out) - 20], out[len(out) - 20:]
    assert all(e in examples for e in alone) and len({id(e) for e in alone}) == 20
    assert all(len(e.input_ids) <= 64 for e in joined)
    assert len(joined) < 20  # chained, not copied one by one
    pieces = {e.input_ids[0]: e for e in examples}
    seen = []
    for e in joined:
        at = 0
        while at < len(e.input_ids):  # every piece starts at a multiple of 100 (its example's first id)
            piece = pieces[e.input_ids[at]]
            n = len(piece.input_ids)
            assert e.input_ids[at: at + n] == piece.input_ids and e.loss_mask[at: at + n] == piece.loss_mask
            seen.append(piece.input_ids[0])
            at += n
    assert sorted(seen + [e.input_ids[0] for e in alone]) == sorted(pieces)
    assert join_examples(examples, 64, 0.5, seed=3) == out and join_examples(examples, 64, 0.5, seed=4) != out
    with pytest.raises(AnchorspecError, match="join-share"):
        join_examples(examples, 64, 0.0, seed=3)


def test_join_to_trains_on_long_sequences_and_keeps_heldout_alone(setup, tmp_path):  # noqa: F811
    """The trainer chains only training conversations (held-out ones are scored whole and alone, as before), its
    batches hold sequences past --max-len's single conversations, and --resume refuses another --join-to."""
    plain = Trainer(config(setup, tmp_path / "a"))
    joined = Trainer(config(setup, tmp_path / "b", join_to=192, join_share=1.0, batch_tokens=192))
    assert [plain.examples[i].input_ids for i in plain.held_idx] == [joined.examples[i].input_ids for i in joined.held_idx]
    longest = max(len(joined.examples[i].input_ids) for i in joined.train_idx)
    assert longest > max(len(plain.examples[i].input_ids) for i in plain.train_idx) and longest <= 192
    assert sum(sum(joined.examples[i].loss_mask) for i in joined.train_idx) == \
        sum(sum(plain.examples[i].loss_mask) for i in plain.train_idx)
    joined.run()
    with pytest.raises(AnchorspecError, match="join_to"):
        Trainer(dataclasses.replace(config(setup, tmp_path / "b", join_to=128, join_share=1.0, batch_tokens=192),
                                    resume=True)).run()
    with pytest.raises(AnchorspecError, match="longer than --batch-tokens"):
        Trainer(config(setup, tmp_path / "c", join_to=256, batch_tokens=192))
    with pytest.raises(AnchorspecError, match="feature cache"):
        Trainer(config(setup, tmp_path / "d", join_to=64, feature_cache=str(tmp_path / "fc")))
