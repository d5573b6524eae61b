"""Released corpora (token-id parts with provenance) and continued training (--init-from, --init-head):
a corpus trains exactly like the conversations it was packed from, parts are checked on read, packing is
incremental and keeps evaluation prompts out, and a continued run starts from the given drafter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from anchorspec.data.corpus import (corpus_summary, is_corpus, iter_packed, pack_answers, read_corpus,
                                    split_selection, write_part)
from anchorspec.data.chat import render_with_loss_mask
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import load_drafter
from anchorspec.train.trainer import Trainer
from train_world import DRAFT_VOCAB, config, make_conversations, make_tokenizer, setup  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def regenerate_records(convs, prefix="src"):
    return [{"id": f"{prefix}:{i}", "messages": c, "finish": "stop", "new_tokens": 3} for i, c in enumerate(convs)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_write_and_read_parts_round_trip(tmp_path):
    pairs = [([1, 2, 3, 70000 % 96], [0, 1, 1, 0]), ([5, 6], [1, 1])]
    npz = write_part(tmp_path, pairs, vocab_size=96, provenance={"source": "x"})
    write_part(tmp_path, [([7], [1])], vocab_size=96, provenance={"source": "y"})
    assert npz.name == "part-0000.npz" and (tmp_path / "part-0001.npz").is_file() and is_corpus(tmp_path)
    with np.load(npz) as z:
        assert z["tokens"].dtype == np.uint16 and z["offsets"].tolist() == [0, 4, 6]
    back = read_corpus(tmp_path, vocab_size=96)
    assert [(e.input_ids, e.loss_mask) for e in back] == [(list(a), list(b)) for a, b in pairs] + [([7], [1])]
    meta = json.loads(npz.with_suffix(".json").read_text())
    assert meta["source"] == "x" and meta["conversations"] == 2 and meta["tokens"] == 6 and meta["loss_tokens"] == 4
    assert corpus_summary(tmp_path)["conversations"] == 3
    # a big vocabulary needs int32 ids
    big = write_part(tmp_path / "big", [([70000], [1])], vocab_size=100_000, provenance={})
    with np.load(big) as z:
        assert z["tokens"].dtype == np.int32 and z["tokens"].tolist() == [70000]


def test_corrupt_or_foreign_parts_are_refused(tmp_path):
    npz = write_part(tmp_path, [([1, 2], [0, 1])], vocab_size=96, provenance={})
    with pytest.raises(AnchorspecError, match="vocabulary of 96"):
        read_corpus(tmp_path, vocab_size=50)
    blob = bytearray(npz.read_bytes())
    blob[-5] ^= 0xFF
    npz.write_bytes(bytes(blob))
    with pytest.raises(AnchorspecError, match="sha256"):
        read_corpus(tmp_path)
    with pytest.raises(AnchorspecError, match="no corpus parts"):
        read_corpus(tmp_path / "nothing")


def test_a_selection_reads_only_the_named_parts(tmp_path):
    for k in range(5):
        write_part(tmp_path, [([k + 1], [1])], vocab_size=96, provenance={"ids": [f"r{k}"]})
    assert split_selection(tmp_path) == (tmp_path, None)
    assert split_selection(f"{tmp_path}:0000,0002-0003") == (tmp_path, [0, 2, 3])
    assert [e.input_ids for e in read_corpus(f"{tmp_path}:3,0-1")] == [[1], [2], [4]]  # part order, not spec order
    assert [pid for pid, _, _ in iter_packed(f"{tmp_path}:0004")] == ["r4"]
    assert is_corpus(f"{tmp_path}:0001") and len(read_corpus(tmp_path)) == 5
    with pytest.raises(AnchorspecError, match="has no part 0005, 0006"):
        read_corpus(f"{tmp_path}:0003-0006")
    with pytest.raises(AnchorspecError, match="runs backwards"):
        read_corpus(f"{tmp_path}:0003-0001")
    # a folder whose own name ends in something that looks like a selection is still that folder
    odd = tmp_path / "run:0001"
    write_part(odd, [([9], [1])], vocab_size=96, provenance={})
    assert split_selection(odd) == (odd, None) and [e.input_ids for e in read_corpus(odd)] == [[9]]


def test_pack_answers_filters_dedupes_and_is_incremental(setup, tmp_path):
    target_dir, _ = setup
    convs = make_conversations(6, seed=4)
    evals = tmp_path / "eval"
    (evals / "mt_bench").mkdir(parents=True)
    leaked = convs[2][0]["content"]  # this user prompt is an evaluation prompt
    (evals / "mt_bench" / "question.jsonl").write_text(json.dumps({"turns": [leaked]}) + "\n")
    first = write_jsonl(tmp_path / "a.jsonl", regenerate_records(convs[:4]) + regenerate_records([convs[0]], "dup"))
    out = tmp_path / "corpus"
    rep = pack_answers([str(first)], out, str(target_dir), eval_data=evals, info={"temperature": "0"})
    assert (rep["new_records"], rep["kept"], rep["contaminated"], rep["duplicates"]) == (5, 3, 1, 1)
    assert rep["already_packed"] == 0
    meta = json.loads((out / "part-0000.json").read_text())
    assert meta["ids"] == ["src:0", "src:1", "src:3"] and meta["temperature"] == "0"
    assert meta["sources"] == {"src": 3} and meta["eval_filter"] == ["mt_bench/question.jsonl"]
    tok = make_tokenizer()
    want = [render_with_loss_mask(tok, convs[i]) for i in (0, 1, 3)]
    assert [(e.input_ids, e.loss_mask) for e in read_corpus(out)] == [(list(a), list(b)) for a, b in want]
    # the answers file grows: only records no part holds are looked at (the dropped one again), one new part
    write_jsonl(first, regenerate_records(convs[:6]))
    rep2 = pack_answers([str(first)], out, str(target_dir), eval_data=evals)
    assert (rep2["new_records"], rep2["already_packed"], rep2["kept"], rep2["contaminated"]) == (3, 3, 2, 1)
    assert len(rep2["new_parts"]) == 1 and rep2["conversations"] == 5


def test_pack_corpus_says_when_every_record_is_packed_already(setup, tmp_path, capsys):
    """Ids are prompt ids: answers sampled again for packed prompts must not vanish without a word."""
    from anchorspec.cli import main

    target_dir, _ = setup
    convs = make_conversations(3, seed=5)
    answers = write_jsonl(tmp_path / "a.jsonl", regenerate_records(convs))
    out, evals = tmp_path / "corpus", tmp_path / "eval"
    (evals / "mt_bench").mkdir(parents=True)
    (evals / "mt_bench" / "question.jsonl").write_text(json.dumps({"turns": ["an evaluation prompt"]}) + "\n")
    argv = ["pack-corpus", str(answers), "--target", str(target_dir), "--out", str(out), "--eval-data", str(evals)]
    assert main(argv) == 0
    assert "already" not in capsys.readouterr().err
    write_jsonl(answers, regenerate_records(make_conversations(3, seed=6)))  # the same ids, other answers
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "all 3 records are in" in captured.err and "folder of their own" in captured.err
    assert json.loads(captured.out)["conversations"] == 3


def test_corpus_trains_exactly_like_its_conversations(setup, tmp_path):
    target_dir, data = setup
    convs = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    tok = make_tokenizer()
    corpus = tmp_path / "corpus"
    write_part(corpus, [render_with_loss_mask(tok, c) for c in convs], vocab_size=len(tok), provenance={})
    a = Trainer(config(setup, tmp_path / "a", max_steps=3))
    b = Trainer(config(setup, tmp_path / "b", max_steps=3, data=[str(corpus)]))
    assert [(e.input_ids, e.loss_mask) for e in a.examples] == [(e.input_ids, e.loss_mask) for e in b.examples]
    a.run()
    b.run()
    for k, v in a.drafter.state_dict().items():
        assert torch.equal(v, b.drafter.state_dict()[k]), k
    with pytest.raises(AnchorspecError, match="re-render"):
        Trainer(config(setup, tmp_path / "c", data=[str(corpus)], system="drop"))


def test_init_from_continues_the_given_drafter(setup, tmp_path):
    first = Trainer(config(setup, tmp_path / "first", max_steps=4, variant="eagle3"))
    first.run()
    src = tmp_path / "first" / "final"
    cont = Trainer(config(setup, tmp_path / "cont", max_steps=3, variant=None, draft_vocab_size=None,
                          init_from=str(src), lr=1e-3))
    assert cont.cfg.variant == "eagle3" and cont.drafter.config.draft_vocab_size == DRAFT_VOCAB
    saved = load_drafter(src, torch.float64).state_dict()
    for k, v in cont.drafter.state_dict().items():  # step 0 is the given drafter, d2t/t2d included
        assert torch.equal(v, saved[k].to(v.dtype)), k
    start = cont.evaluate()
    cont.run()
    assert any(not torch.equal(v, saved[k].to(v.dtype)) for k, v in cont.drafter.state_dict().items())
    # the start is scored first, on this run's held-out set: the baseline the round has to beat
    evals = [r for r in map(json.loads, (tmp_path / "cont" / "metrics.jsonl").read_text().splitlines()) if "eval" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval"]["heldout_acc"] == start["heldout_acc"]
    # ... with its fit gap, as the end is: did the round memorise (start and end on the same conversations)
    assert [("fit" in r["eval"]) for r in evals] == [True] + [False] * (len(evals) - 2) + [True]
    assert evals[0]["eval"]["fit"]["heldout_acc"] == start["heldout_acc"]
    assert not any(r["step"] == 0 for r in map(json.loads, (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()))
    run = json.loads((tmp_path / "cont" / "run.json").read_text())
    assert run["config"]["init_from"] == str(src) and run["config"]["variant"] == "eagle3"
    # flags that contradict the drafter are refused, each with its own line
    with pytest.raises(AnchorspecError, match="not --variant eagle3.1"):
        Trainer(config(setup, tmp_path / "x", variant="eagle3.1", draft_vocab_size=None, init_from=str(src)))
    with pytest.raises(AnchorspecError, match="draft vocabulary of 48"):
        Trainer(config(setup, tmp_path / "y", variant=None, draft_vocab_size=32, init_from=str(src)))
    with pytest.raises(AnchorspecError, match="keeps the drafter's own head"):
        Trainer(config(setup, tmp_path / "z", init_from=str(src), init_head="target"))


def test_init_head_target_copies_the_targets_head_rows(setup, tmp_path):
    t = Trainer(config(setup, tmp_path / "h", init_head="target"))
    ids = t.drafter.draft_to_target
    head = t.target.model.get_output_embeddings().weight
    assert torch.equal(t.drafter.lm_head.weight, head[ids].to(t.drafter.lm_head.weight.dtype))
    assert torch.equal(t.drafter.norm.weight, t.target.model.model.norm.weight.to(t.drafter.norm.weight.dtype))
    r = Trainer(config(setup, tmp_path / "r"))  # negative control: the default head is random
    assert not torch.equal(r.drafter.lm_head.weight, head[r.drafter.draft_to_target].to(r.drafter.lm_head.weight.dtype))


def _last_layer_io(model, input_ids):
    """(input, output) hidden states of the target's last decoder layer on `input_ids`."""
    seen = {}

    def hook(module, args, output):
        seen["in"], seen["out"] = args[0], output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        handle.remove()
    return seen["in"], seen["out"]


def test_init_layer_target_starts_as_the_targets_last_layer(setup, tmp_path):
    from anchorspec.models.drafter import CAUSAL, KVCache

    t = Trainer(config(setup, tmp_path / "l", init_layer="target"))
    d, target = t.drafter, t.target.model
    ids = torch.tensor([[3, 17, 5, 40, 9, 22, 11]])
    h_in, h_out = _last_layer_io(target, ids)
    cos, sin = d.rope(torch.arange(ids.shape[1])[None], h_in.dtype)
    # with no embedding the drafter's layer is the target's layer: same state in, same state out
    ours, _ = d.midlayer(torch.zeros_like(h_in), h_in, cos, sin, KVCache(), CAUSAL, False)
    torch.testing.assert_close(ours, h_out, rtol=1e-6, atol=1e-7)  # both RoPEs are computed in fp32
    # fc passes the highest captured state through (the other blocks zeroed to isolate it)
    Ht = d.config.target_hidden_size
    with torch.no_grad():
        d.fc.weight[:, : -Ht].zero_()
    aux = torch.randn(2, 5, d.fc.in_features, dtype=d.fc.weight.dtype)
    torch.testing.assert_close(d.project_features(aux), d.fc_norm[-1](aux[..., -Ht:]))
    # the token still reaches the layer: the embedding half of q/k/v keeps its random start
    assert d.midlayer.self_attn.q_proj.weight[:, :Ht].abs().sum() > 0
    # negative control: the default random layer is not the target's
    r = Trainer(config(setup, tmp_path / "r"))
    theirs, _ = r.drafter.midlayer(torch.zeros_like(h_in), h_in, cos, sin, KVCache(), CAUSAL, False)
    assert not torch.allclose(theirs, h_out, atol=1e-3)
    with pytest.raises(AnchorspecError, match="keeps the drafter's own layer"):
        Trainer(config(setup, tmp_path / "z", init_from=str(tmp_path / "l"), init_layer="target"))


def test_init_layer_target_reads_stock_weights_when_the_target_is_prepacked(setup, tmp_path, monkeypatch):
    from anchorspec.models.packed import is_packed, packing_supported

    if not packing_supported(torch.float32, "cpu"):
        pytest.skip("oneDNN weight packing is not available in this torch build")
    monkeypatch.setenv("ANCHORSPEC_PACK", "on")
    t = Trainer(config(setup, tmp_path / "p", init_layer="target", dtype="float32"))
    assert is_packed(t.target.model)  # the training target is packed; the layer came from stock weights
    from safetensors.torch import load_file

    stock = load_file(str(setup[0] / "model.safetensors"))
    last = t.target.model.config.num_hidden_layers - 1
    H = t.drafter.config.hidden_size
    got = t.drafter.midlayer.mlp.down_proj.weight
    assert torch.equal(got, stock[f"model.layers.{last}.mlp.down_proj.weight"].to(got.dtype))
    got = t.drafter.midlayer.self_attn.k_proj.weight[:, H:]
    assert torch.equal(got, stock[f"model.layers.{last}.self_attn.k_proj.weight"].to(got.dtype))


def test_revocab_reselects_the_vocabulary_and_keeps_shared_rows(setup, tmp_path):
    from anchorspec.models.drafter import save_drafter
    from anchorspec.train.vocab import coverage, select_draft_vocab

    first = Trainer(config(setup, tmp_path / "first", max_steps=2, variant="eagle3"))
    first.run()
    # a drafter whose vocabulary was chosen on other data: half its ids are tokens this data never uses
    d = load_drafter(tmp_path / "first" / "final", torch.float64)
    counts = torch.bincount(torch.tensor([t for e in first.train_examples for t, m in zip(e.input_ids, e.loss_mask)
                                          if m]), minlength=d.config.vocab_size)
    best = select_draft_vocab(counts, DRAFT_VOCAB)
    unused = torch.nonzero(counts == 0).view(-1)
    assert unused.numel() >= DRAFT_VOCAB // 2
    used = best[counts[best] > 0]
    assert used.numel() >= DRAFT_VOCAB // 2
    # the highest unused ids: select_draft_vocab pads with the lowest, so these are not in `best`
    other = torch.sort(torch.cat([used[: DRAFT_VOCAB // 2], unused[-(DRAFT_VOCAB // 2):]])).values
    assert other.unique().numel() == DRAFT_VOCAB
    d.set_vocab_mapping(other)
    save_drafter(d, tmp_path / "other")
    old_rows = dict(zip(other.tolist(), d.lm_head.weight.detach()))

    plain = Trainer(config(setup, tmp_path / "plain", max_steps=1, variant=None, draft_vocab_size=None,
                           init_from=str(tmp_path / "other")))
    assert torch.equal(plain.drafter.draft_to_target, other)  # negative control: without --revocab nothing moves
    t = Trainer(config(setup, tmp_path / "re", max_steps=1, variant=None, draft_vocab_size=None,
                       init_from=str(tmp_path / "other"), revocab=True))
    new = t.drafter.draft_to_target
    assert not torch.equal(new, other) and new.numel() == DRAFT_VOCAB
    assert t.vocab_coverage > plain.vocab_coverage
    assert t.vocab_coverage == pytest.approx(coverage(counts_of(t), new))
    head = t.target.model.get_output_embeddings().weight
    kept = 0
    for row, tok in zip(t.drafter.lm_head.weight, new.tolist()):
        if tok in old_rows:
            assert torch.equal(row, old_rows[tok].to(row.dtype)), tok
            kept += 1
        else:
            assert torch.equal(row, head[tok].to(row.dtype)), tok
    assert 0 < kept < DRAFT_VOCAB
    t.run()
    run = json.loads((tmp_path / "re" / "run.json").read_text())
    assert run["draft_vocab"]["revocab"]["kept_rows"] == kept and run["config"]["revocab"] is True
    assert load_drafter(tmp_path / "re" / "final", torch.float64).draft_to_target.tolist() == new.tolist()
    with pytest.raises(AnchorspecError, match="needs --init-from"):
        Trainer(config(setup, tmp_path / "n", revocab=True))

    # a larger draft vocabulary: every old row is kept, the new ones start from the target's head
    with pytest.raises(AnchorspecError, match="add --revocab"):
        Trainer(config(setup, tmp_path / "g0", max_steps=1, variant=None, draft_vocab_size=2 * DRAFT_VOCAB,
                       init_from=str(tmp_path / "re" / "final")))
    g = Trainer(config(setup, tmp_path / "g", max_steps=1, variant=None, draft_vocab_size=2 * DRAFT_VOCAB,
                       init_from=str(tmp_path / "re" / "final"), revocab=True))
    grown = g.drafter.draft_to_target
    assert grown.numel() == g.drafter.lm_head.weight.shape[0] == 2 * DRAFT_VOCAB and set(new.tolist()) < set(grown.tolist())
    trained = dict(zip(new.tolist(), load_drafter(tmp_path / "re" / "final", torch.float64).lm_head.weight))
    from anchorspec.train.vocab import head_map
    mapping = head_map(new, torch.stack([trained[tok] for tok in new.tolist()]), head)
    start = head if mapping is None else (head.double() @ mapping).to(head.dtype)
    for row, tok in zip(g.drafter.lm_head.weight, grown.tolist()):
        assert torch.equal(row, (trained[tok] if tok in trained else start[tok]).to(row.dtype)), tok
    assert g.revocab_report["kept_rows"] == DRAFT_VOCAB and g.revocab_report["size_before"] == DRAFT_VOCAB
    g.run()
    again = load_drafter(tmp_path / "g" / "final", torch.float64)
    assert again.config.draft_vocab_size == 2 * DRAFT_VOCAB and again.draft_to_target.tolist() == grown.tolist()


def test_new_head_rows_start_in_the_drafters_own_scale():
    """A drafter whose head is a linear map of the target's: the rows of tokens it never had come out of
    the fitted map exactly (float64), where the target's rows as they are would be off by the map."""
    from anchorspec.train.vocab import head_map, remap_head_rows

    g = torch.Generator().manual_seed(0)
    target_head = torch.randn(300, 8, generator=g, dtype=torch.float64)
    true_map = torch.randn(8, 6, generator=g, dtype=torch.float64) * 0.3
    old_ids = torch.arange(0, 200, 2)  # 100 rows >= 2 x 8
    mapping = head_map(old_ids, target_head[old_ids] @ true_map, target_head)
    torch.testing.assert_close(mapping, true_map)
    new_ids = torch.tensor([4, 5, 7, 250])
    rows, kept = remap_head_rows(old_ids, target_head[old_ids] @ true_map, new_ids, target_head @ mapping)
    torch.testing.assert_close(rows, target_head[new_ids] @ true_map)
    assert kept == 1
    assert head_map(old_ids[:15], (target_head @ true_map)[old_ids[:15]], target_head) is None  # too few rows


def counts_of(trainer):
    from anchorspec.train.vocab import count_loss_tokens

    return count_loss_tokens(((e.input_ids, e.loss_mask) for e in trainer.train_examples), trainer.target.vocab_size)
