"""The TTT trainer stack (anchorspec.train.{dataset,features,trainer}): batch order, schedules, an end-to-end
run and its outputs, exact resume, the offline feature cache, and the draft-space TTT target path.

Everything runs on a tiny saved Llama (vocab 96, hidden 32, 4 layers) with a word-level ChatML tokenizer, so
the whole file is fast on one CPU thread. Exactness checks run the target and the drafter in float64.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from anchorspec.data.chat import render_with_loss_mask
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import init_drafter, load_drafter
from anchorspec.models.target import load_target
from anchorspec.train import features as feat_mod
from anchorspec.train.dataset import (BatchStream, DataStats, Example, epoch_batches, read_conversations,
                                      split_heldout, tokenize_conversations)
from anchorspec.train.features import FeatureCache, build_feature_cache
from anchorspec.train.trainer import Trainer, TrainConfig, _Accum, lr_factor, simulated_tau
from anchorspec.train.ttt import ttt_forward
from helpers import VOCAB, tiny_config, tiny_target
from train_world import (DRAFT_VOCAB, N_CONVS, config, drafter_state, make_conversations, make_tokenizer,  # noqa: F401
                         read_jsonl, run_interrupted, setup)  # setup: a fixture


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


# --------------------------------------------------------------------------------------------------
# 1. dataset
# --------------------------------------------------------------------------------------------------

LENGTHS = [random.Random(3).randint(3, 30) for _ in range(150)]


def test_epoch_batches_deterministic_complete_and_bounded():
    bt = 64
    e0 = epoch_batches(LENGTHS, bt, seed=5, epoch=0)
    assert e0 == epoch_batches(LENGTHS, bt, seed=5, epoch=0)
    e1 = epoch_batches(LENGTHS, bt, seed=5, epoch=1)
    assert e1 != e0
    assert epoch_batches(LENGTHS, bt, seed=6, epoch=0) != e0
    for batches in (e0, e1, epoch_batches(LENGTHS, bt, seed=6, epoch=3)):
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(LENGTHS)))  # every index exactly once
        for b in batches:
            assert b and len(b) * max(LENGTHS[i] for i in b) <= bt
    assert max(len(b) for b in e0) > 1  # batching actually packs several rows
    with pytest.raises(AnchorspecError, match="batch-tokens"):
        epoch_batches(LENGTHS, max(LENGTHS) - 1, seed=0, epoch=0)


def test_batch_stream_crosses_epochs():
    bt, seed = 64, 2
    s = BatchStream(LENGTHS, bt, seed)
    e = [epoch_batches(LENGTHS, bt, seed, k) for k in range(3)]
    n0, n1 = len(e[0]), len(e[1])
    assert s.per_epoch(0) == n0 and s.total(2) == n0 + n1
    assert s.locate(0) == (0, 0)
    assert s.locate(n0 - 1) == (0, n0 - 1)
    assert s.locate(n0) == (1, 0)
    assert s.locate(n0 + n1 + 2) == (2, 2)
    assert s.get(n0 + n1 + 2) == e[2][2]
    assert s.get(n0 - 1) == e[0][-1]  # going back to an earlier epoch after the cache moved on
    assert s.get(n0 + 3) == e[1][3]
    assert s.get(0) == e[0][0]
    # a fresh stream asked out of order agrees (no hidden state)
    assert BatchStream(LENGTHS, bt, seed).get(n0 + 3) == e[1][3]


def test_split_heldout():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(3, 30, (400,), generator=gen)]
    train, held = split_heldout(seqs, 0.1, seed=1)
    assert 20 <= len(held) <= 60 and not set(train) & set(held) and sorted(train + held) == list(range(400))
    assert (train, held) == split_heldout(seqs, 0.1, seed=1)
    assert held != split_heldout(seqs, 0.1, seed=2)[1]
    # the same examples stay held out when the corpus grows or is reordered (keyed by content)
    more = seqs + [torch.randint(0, 1000, (9,), generator=gen).tolist() for _ in range(200)]
    _, held_more = split_heldout(more, 0.1, seed=1)
    assert set(held) == {i for i in held_more if i < 400} and any(i >= 400 for i in held_more)
    rev = seqs[::-1]
    assert sorted(399 - i for i in split_heldout(rev, 0.1, seed=1)[1]) == held
    train, held = split_heldout(seqs[:10], 0.01, seed=0, minimum=2)
    assert len(held) == 2 and sorted(train + held) == list(range(10))
    train, held = split_heldout(seqs[:2], 0.5, seed=0, minimum=2)  # at least one training example is kept
    assert len(train) == 1 and len(held) == 1
    with pytest.raises(AnchorspecError):
        split_heldout(seqs[:1], 0.5, seed=0)


def test_tokenize_conversations_drops_long_and_lossless(tokenizer):
    convs = make_conversations(30, seed=7, lo=2, hi=20)
    convs.append([{"role": "user", "content": "w1 w2"}])  # no assistant turn: nothing to learn
    max_len = 24
    lengths = [len(render_with_loss_mask(tokenizer, c)[0]) for c in convs[:-1]]
    too_long = sum(L > max_len for L in lengths)
    assert 0 < too_long < len(lengths)
    stats = DataStats()
    ex = tokenize_conversations(tokenizer, convs, max_len, stats=stats)
    assert stats.conversations == len(convs)
    assert stats.dropped_too_long == too_long
    assert stats.dropped_no_loss == 1
    assert stats.examples == len(ex) == len(lengths) - too_long
    assert all(len(e.input_ids) <= max_len and len(e.loss_mask) == len(e.input_ids) for e in ex)
    assert stats.tokens == sum(len(e.input_ids) for e in ex)
    assert stats.loss_tokens == sum(sum(e.loss_mask) for e in ex) > 0
    # kept examples are the short ones, in order, rendered exactly
    kept = [c for c, L in zip(convs, lengths) if L <= max_len]
    assert [e.input_ids for e in ex] == [render_with_loss_mask(tokenizer, c)[0] for c in kept]
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for e in ex:  # the assistant's end-of-turn token is learned
        assert any(i == eot and m for i, m in zip(e.input_ids, e.loss_mask))


def test_read_conversations_rejects_prompt_rows(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(AnchorspecError, match="messages"):
        read_conversations(str(p))


# --------------------------------------------------------------------------------------------------
# 2. schedule and simulated tau
# --------------------------------------------------------------------------------------------------

def test_lr_factor():
    total, warmup = 100, 10
    f = [lr_factor(s, total, warmup) for s in range(total + 5)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5)
    assert all(a < b for a, b in zip(f[:warmup], f[1:warmup]))  # strictly ramps up
    assert f[warmup - 1] == pytest.approx(1.0) and f[warmup] == pytest.approx(1.0)
    assert all(b <= a for a, b in zip(f[warmup:], f[warmup + 1:]))  # monotone decay afterwards
    assert f[warmup + 1] < 1.0
    assert lr_factor(55, total, warmup) == pytest.approx(0.5)  # cosine midpoint
    assert f[total] == pytest.approx(0.0, abs=1e-12) and f[total + 4] == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(0, 30, 0) == pytest.approx(1.0)  # no warmup: starts at the peak


def test_simulated_tau():
    assert simulated_tau([1, 1, 1]) == pytest.approx(4.0)
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_tau([0, 1, 1, 1]) == pytest.approx(1.0)
    assert simulated_tau([]) == pytest.approx(1.0)
    assert simulated_tau(torch.tensor([0.8, 0.5])) == pytest.approx(1 + 0.8 + 0.4)


# --------------------------------------------------------------------------------------------------
# 3. end to end
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_trainer_end_to_end(setup, tmp_path, variant):
    out = tmp_path / "run"
    cfg = config(setup, out, variant=variant, max_steps=30, dtype="float32", batch_tokens=96, eval_every=10,
                 save_every=10, eval_prompts=2, eval_new_tokens=6, eval_replay=3)
    trainer = Trainer(cfg)
    summary = trainer.run()
    assert summary["steps"] == 30 == trainer.step

    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "eval" not in r]
    evals = [r for r in records if "eval" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in evals] == [10, 20, 30]
    first = sum(r["loss"] for r in train[:3]) / 3
    last = sum(r["loss"] for r in train[-3:]) / 3
    assert last < 0.9 * first, (first, last)  # ~9.4 -> ~7.5 on this data
    assert all(len(r["acc_per_step"]) == 3 and 1.0 <= r["train_sim_tau"] <= 4.0 for r in train)

    # best/: the eval with the highest metric (the replay tau, then gen_tau, then sim_tau); ties keep the earliest
    def metric(r):
        return r["eval"].get("replay_tau", r["eval"].get("gen_tau", r["eval"]["sim_tau"]))

    assert all("gen_tau" in r["eval"] and "replay_tau" in r["eval"] for r in evals)
    assert len(trainer.replay_answers) == 3
    best_rec = evals[0]
    for r in evals[1:]:
        if metric(r) > metric(best_rec):
            best_rec = r
    for name in ("config.json", "model.safetensors", "best.json"):
        assert (out / "best" / name).is_file()
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["step"] == best_rec["step"] == summary["best_step"]
    assert best["replay_tau"] == pytest.approx(metric(best_rec))
    # the replay tau is the default tree walked along the held-out answers by the saved drafter
    from anchorspec.api import DEFAULT_TREE, attach_drafter
    from anchorspec.decode.propose import EagleProposer
    from anchorspec.decode.shape import replay
    from anchorspec.metrics import GenerationStats

    saved = load_drafter(out / "best", trainer.target.dtype).eval()
    attach_drafter(trainer.target, saved)
    walked = GenerationStats()
    for seq, start in trainer.replay_answers:
        walked = walked.merge(replay(trainer.target, EagleProposer(saved), torch.tensor(seq), start, DEFAULT_TREE))
    assert walked.verify_steps > 10 and walked.tau == pytest.approx(best["replay_tau"])
    assert [r["best"] for r in evals].count(True) >= 1 and evals[0]["best"] is True

    # final/ is the trained drafter with the variant's flags
    final = load_drafter(out / "final", torch.float32)
    flag = variant == "eagle3.1"
    assert final.config.fc_norm is flag and final.config.norm_output is flag
    assert (final.fc_norm is not None) is flag
    assert final.config.draft_vocab_size == DRAFT_VOCAB
    for k, v in trainer.drafter.state_dict().items():
        assert torch.equal(final.state_dict()[k], v), k

    # checkpoints: latest names the one remaining step dir
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "trainer_state.pt").is_file()
    assert (out / "checkpoints" / latest / "model.safetensors").is_file()
    assert torch.load(out / "checkpoints" / latest / "trainer_state.pt", weights_only=True)["step"] == 30
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [latest]

    run = json.loads((out / "run.json").read_text())
    d = run["data"]
    assert d["conversations"] == N_CONVS and d["examples"] == N_CONVS
    assert d["train"] + d["heldout"] == N_CONVS and d["heldout"] == len(trainer.held_idx) >= 2
    assert trainer.held_idx == split_heldout([e.input_ids for e in trainer.examples], 0.1, 0, minimum=2)[1]
    assert d["loss_tokens"] > 0 and d["tokens"] > d["loss_tokens"]
    assert run["draft_vocab"]["size"] == DRAFT_VOCAB and 0 < run["draft_vocab"]["coverage"] <= 1
    assert run["total_steps"] == 30 and run["summary"]["steps"] == 30
    assert run["config"]["variant"] == variant
    # the fit gap: scored at the last evaluation only (no --init-from: no start to score), beside its held-out figures
    fit = run["summary"]["fit"]
    assert fit == evals[-1]["eval"]["fit"] and all("fit" not in r["eval"] for r in evals[:-1])
    assert fit["heldout_acc"] == evals[-1]["eval"]["heldout_acc"]
    assert fit["scored"] == len(trainer.scored_heldout()) and len(fit["train_acc"]) == 3
    assert all(0 <= a <= 1 for a in fit["train_acc"])
    assert fit["gap"] == pytest.approx([t - h for t, h in zip(fit["train_acc"], fit["heldout_acc"])])
    png = out / "training.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bfloat16_autocast_run(setup, tmp_path):
    """The default dtype: a bf16 target under CPU autocast, float32 masters that do move."""
    t = Trainer(config(setup, tmp_path / "bf", dtype="bfloat16", max_steps=2))
    assert t.target.dtype == torch.bfloat16 and t.autocast
    start = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    t.run()
    assert all(p.dtype == torch.float32 for p in t.drafter.parameters())
    assert any(not torch.equal(start[k], v) for k, v in t.drafter.state_dict().items())
    recs = [r for r in read_jsonl(tmp_path / "bf" / "metrics.jsonl") if "eval" not in r]
    assert len(recs) == 2 and all(0 < r["loss"] < float("inf") for r in recs)
    saved = drafter_state(tmp_path / "bf" / "final")
    assert saved["fc.weight"].dtype == torch.float32 and "embed_weight" not in saved


def test_epochs_set_total_steps(setup, tmp_path):
    cfg = config(setup, tmp_path / "e", max_steps=None, epochs=2)
    t = Trainer(cfg)
    assert t.total_steps == t.stream.total(2) > 2
    with pytest.raises(AnchorspecError, match="exactly one"):
        config(setup, tmp_path / "x", max_steps=3, epochs=1).validate()


# --------------------------------------------------------------------------------------------------
# 4. resume exactness
# --------------------------------------------------------------------------------------------------

def test_resolve_device():
    from anchorspec.models.dtype import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("CPU") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(AnchorspecError, match="--device must be auto, cpu or cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(AnchorspecError, match="sees no CUDA GPU"):
            resolve_device("cuda:0")


def test_gpu_training_decodes_its_evaluation_on_a_cpu_copy(setup, tmp_path):
    """Training on a GPU, the evaluation's decoding gets a CPU copy of the target (loaded once, same dtype and
    captured layers); on a CPU it is the training target itself."""
    t = Trainer(config(setup, tmp_path / "run", dtype="float32"))
    assert t._decode_target() is t.target
    t.device = torch.device("cuda")  # what a GPU run holds; _decode_target itself runs nothing there
    copy = t._decode_target()
    assert copy is not t.target and copy is t._decode_target()
    assert copy.embed_weight.device.type == "cpu" and copy.dtype == t.target.dtype
    assert copy.aux_layer_ids == t.target.aux_layer_ids
    assert torch.equal(copy.embed_weight, t.target.embed_weight)


def test_feature_cache_is_refused_on_a_gpu(setup, tmp_path, monkeypatch):
    """The offline cache lives on the CPU: a GPU run that asks for it gets one line at once, before any load."""
    from anchorspec.train import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(AnchorspecError, match="drop --feature-cache"):
        Trainer(config(setup, tmp_path / "run", feature_cache=str(tmp_path / "cache")))
    assert not (tmp_path / "cache").exists()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (run on the device machine; CI has none)")


@CUDA
def test_cuda_training_equals_cpu(setup, tmp_path):
    """float64 on both devices: the same accuracies, and losses and weights equal to round-off. Not bit-equal:
    transformers computes RoPE and RMSNorm in fp32 even in a float64 model, and CPU and CUDA fp32 kernels differ
    in the last bits (an H100 measured 9e-10 relative on the first loss, 3e-9 by step 4)."""
    kw = dict(max_steps=4, eval_every=2, dtype="float64")
    cpu = Trainer(config(setup, tmp_path / "cpu", device="cpu", **kw))
    cpu.run()
    gpu = Trainer(config(setup, tmp_path / "gpu", device="cuda", **kw))
    gpu.run()
    assert gpu.target.embed_weight.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in gpu.drafter.parameters())
    ra, rb = read_jsonl(tmp_path / "cpu" / "metrics.jsonl"), read_jsonl(tmp_path / "gpu" / "metrics.jsonl")
    assert [(r["step"], "eval" in r) for r in ra] == [(r["step"], "eval" in r) for r in rb]
    for a, b in zip(ra, rb):
        if "eval" in a:
            assert b["eval"]["heldout_acc"] == pytest.approx(a["eval"]["heldout_acc"], abs=1e-12)
        else:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-7)
            assert b["acc_per_step"] == pytest.approx(a["acc_per_step"], abs=1e-12)
    fa, fb = drafter_state(tmp_path / "cpu" / "final"), drafter_state(tmp_path / "gpu" / "final")
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fb[k].device.type == "cpu" and torch.allclose(fa[k], fb[k], rtol=1e-6, atol=1e-9), k


@CUDA
def test_cuda_evaluation_decodes_like_cpu(setup, tmp_path):
    """Training on the GPU, the evaluation's real decoding (the replay tau and generate's tau, float64, on a CPU
    copy of the target) gives the figures of a run on the CPU."""
    kw = dict(max_steps=2, eval_every=2, eval_prompts=1, eval_new_tokens=6, eval_replay=2, dtype="float64")
    evals = []
    for device in ("cpu", "cuda"):
        Trainer(config(setup, tmp_path / device, device=device, **kw)).run()
        evals.append([r["eval"] for r in read_jsonl(tmp_path / device / "metrics.jsonl") if "eval" in r])
    assert evals[0] and [(e["replay_tau"], e["gen_tau"]) for e in evals[1]] == \
        [(e["replay_tau"], e["gen_tau"]) for e in evals[0]]


@CUDA
def test_cuda_bfloat16_autocast_run(setup, tmp_path, monkeypatch):
    """The GPU's own dtype: a bf16 target under CUDA autocast, and a run killed after its step-2 checkpoint
    resumes on the GPU (its optimizer state back there) to the end, its fp32 masters on the GPU and moved."""
    bf16_run_resumed(setup, tmp_path, monkeypatch, "cuda")


def bf16_run_resumed(setup, tmp_path, monkeypatch, device: str) -> None:
    """A bf16 run on `device` killed after its step-2 checkpoint, then resumed there to step 3 (the body of
    the CUDA test above; on the CPU it runs the same, which is how it was checked without a GPU)."""
    cfg = config(setup, tmp_path / "bf", dtype="bfloat16", device=device, max_steps=3, save_every=2)
    run_interrupted(cfg, monkeypatch, at_step=2)
    assert (tmp_path / "bf" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    t = Trainer(dataclasses.replace(cfg, resume=True))
    assert t.target.dtype == torch.bfloat16 and t.autocast
    start = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    t.run()
    assert t.step == 3
    assert all(p.dtype == torch.float32 and p.device.type == device for p in t.drafter.parameters())
    assert all(v.device.type == device for state in t.optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)
    assert any(not torch.equal(start[k], v) for k, v in t.drafter.state_dict().items())
    recs = [r for r in read_jsonl(tmp_path / "bf" / "metrics.jsonl") if "eval" not in r]
    assert len(recs) == 3 and all(0 < r["loss"] < float("inf") for r in recs)


def test_resume_is_exact(setup, tmp_path, monkeypatch):
    kw = dict(max_steps=6, save_every=2, eval_every=3, eval_prompts=1)
    a_out, b_out = tmp_path / "a", tmp_path / "b"
    Trainer(config(setup, a_out, **kw)).run()

    cfg_b = config(setup, b_out, **kw)
    run_interrupted(cfg_b, monkeypatch, at_step=3)
    assert (b_out / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    assert 3 in [r["step"] for r in read_jsonl(b_out / "metrics.jsonl")]  # stale work past the checkpoint
    assert not (b_out / "final").exists()

    resumed = Trainer(dataclasses.replace(cfg_b, resume=True))
    resumed.run()
    assert resumed.step == 6

    a, b = drafter_state(a_out / "final"), drafter_state(b_out / "final")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for k, v in drafter_state(b_out / "checkpoints" / "step-0000006").items():  # the last checkpoint too
        assert torch.equal(a[k], v), k

    ra, rb = read_jsonl(a_out / "metrics.jsonl"), read_jsonl(b_out / "metrics.jsonl")
    key = [(r["step"], "eval" in r) for r in rb]
    assert len(key) == len(set(key)), "duplicate metrics lines after resume"
    assert key == [(r["step"], "eval" in r) for r in ra]
    assert [r.get("loss") for r in rb] == [r.get("loss") for r in ra]
    assert [r.get("acc_per_step") for r in rb] == [r.get("acc_per_step") for r in ra]
    assert json.loads((b_out / "best" / "best.json").read_text())["step"] == \
        json.loads((a_out / "best" / "best.json").read_text())["step"]

    with pytest.raises(AnchorspecError, match=r"\blr\b"):
        Trainer(dataclasses.replace(cfg_b, resume=True, lr=1e-3)).run()
    with pytest.raises(AnchorspecError, match="--resume"):
        Trainer(dataclasses.replace(cfg_b, resume=False)).run()
    for k, v in drafter_state(b_out / "final").items():  # the refused runs touched nothing
        assert torch.equal(a[k], v)


# --------------------------------------------------------------------------------------------------
# 5. offline feature cache
# --------------------------------------------------------------------------------------------------

def test_cached_features_equal_online(setup, tmp_path):
    online = Trainer(config(setup, tmp_path / "on"))
    cached = Trainer(config(setup, tmp_path / "off", feature_cache=str(tmp_path / "cache")))
    assert cached.cache is not None and len(cached.cache) == N_CONVS
    assert online.train_idx == cached.train_idx
    for idx in (cached.train_idx[:10], cached.held_idx + cached.train_idx[10:14], cached.train_idx[-12:]):
        bo, bc = online._batch(idx), cached._batch(idx)
        # both hand TTT draft-vocabulary logits and the in-draft flag of the target's full-vocabulary argmax
        real = bo[4].bool()  # padding rows differ (the cache stores nothing there) and are never scored
        assert bo[2].shape[-1] == bc[2].shape[-1] == DRAFT_VOCAB and torch.equal(bo[5][real], bc[5][real])
        torch.testing.assert_close(bo[2][real], bc[2][real], atol=1e-9, rtol=0)
        lo, lko, ao, vo, _ = online.objective(*bo)
        lc, lkc, ac, vc, _ = cached.objective(*bc)
        assert torch.equal(vo, vc) and int(vo.sum()) > 0
        torch.testing.assert_close(lc, lo, atol=1e-9, rtol=0)
        torch.testing.assert_close(lkc, lko, atol=1e-9, rtol=0)
        torch.testing.assert_close(ac.double(), ao.double(), atol=1e-9, rtol=0)
    start = cached.drafter.fc.weight.detach().clone()
    for t in (online, cached):
        w = _Accum()
        for _ in range(3):
            t.train_step(w)
    so, sc = online.drafter.state_dict(), cached.drafter.state_dict()
    for k in so:
        torch.testing.assert_close(sc[k], so[k], atol=1e-9, rtol=0)
    # training changed the weights, so the comparison was not of two initial states
    assert (sc["fc.weight"] - start).abs().max() > 1e-4


def _examples(setup):
    target = load_target(str(setup[0]), "float64")
    convs = read_conversations(str(setup[1]))
    return target, tokenize_conversations(target.tokenizer, convs, 64)


def test_feature_cache_resumes_missing_shard(setup, tmp_path, monkeypatch):
    target, examples = _examples(setup)
    d = tmp_path / "cache"
    index = build_feature_cache(target, examples, d, batch_tokens=64, shard_tokens=100, progress=False)
    shards = index["shards"]
    assert len(shards) >= 4
    assert sum(s["count"] for s in shards) == len(examples) and index["tokens"] == sum(len(e.input_ids) for e in examples)
    before = FeatureCache(d, examples)
    orig = [tuple(t.clone() for t in before.get(i)) for i in range(len(examples))]
    for i, e in enumerate(examples):  # what was stored is the target's own output
        aux, hidden, argmax = orig[i]
        assert aux.shape == (len(e.input_ids), 3 * 32) and hidden.shape == (len(e.input_ids), 32)
        assert aux.dtype == hidden.dtype == torch.float64
    single = target.features(torch.tensor([examples[5].input_ids]))
    torch.testing.assert_close(orig[5][0], single.aux[0], atol=1e-12, rtol=0)
    assert torch.equal(orig[5][2].long(), single.logits[0].argmax(-1))

    victim = shards[2]
    (d / victim["file"]).unlink()
    ix = json.loads((d / "index.json").read_text())
    del ix["shards"][victim["fingerprint"]]
    (d / "index.json").write_text(json.dumps(ix))
    with pytest.raises(AnchorspecError, match="incomplete"):
        FeatureCache(d, examples)

    seen = []
    real = feat_mod.compute_features

    def counting(target_, ids, pm, check_head=False):
        seen.extend(tuple(row[: int(m.sum())].tolist()) for row, m in zip(ids, pm))
        return real(target_, ids, pm, check_head=check_head)

    monkeypatch.setattr(feat_mod, "compute_features", counting)
    again = build_feature_cache(target, examples, d, batch_tokens=64, shard_tokens=100, progress=False)
    lost = examples[victim["first"]: victim["first"] + victim["count"]]
    assert sorted(seen) == sorted(tuple(e.input_ids) for e in lost)  # only that shard was recomputed
    assert [s["file"] for s in again["shards"]] == [s["file"] for s in shards]
    assert again["tokens"] == index["tokens"]
    after = FeatureCache(d, examples)
    for i in range(len(examples)):
        for x, y in zip(orig[i], after.get(i)):
            assert torch.equal(x, y), i

    seen.clear()
    build_feature_cache(target, examples, d, batch_tokens=64, shard_tokens=100, progress=False)
    assert seen == []  # a complete cache is not recomputed

    # the corpus grows by a part: the full shards are reused, only the old tail and the new examples run
    grown = examples + examples[:3]
    built = build_feature_cache(target, grown, d, batch_tokens=64, shard_tokens=100, progress=False)
    tail_first = shards[-1]["first"] if shards[-1]["tokens"] < 100 else len(examples)
    assert sorted(seen) == sorted(tuple(e.input_ids) for e in grown[tail_first:])
    assert [s["file"] for s in built["shards"][:-1]] == [s["file"] for s in shards[:-1]]
    grown_cache = FeatureCache(d, grown)
    for i in range(len(examples)):  # reused shards are the same bytes; the recomputed tail agrees
        for x, y in zip(orig[i], grown_cache.get(i)):
            if i < tail_first:
                assert torch.equal(x, y), i
            else:
                torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    for i in range(3):
        for x, y in zip(orig[i], grown_cache.get(len(examples) + i)):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    # a shard of examples no longer in the data is dropped from the index and from disk
    files = {p.name for p in d.glob("shard-*.safetensors")}
    assert files == {s["file"] for s in built["shards"]}
    with pytest.raises(AnchorspecError, match="other examples"):  # the index now describes the grown data
        FeatureCache(d, examples)

    # another target (dtype) is refused on build, never mixed into the same cache
    with pytest.raises(AnchorspecError, match="another target"):
        build_feature_cache(load_target(str(setup[0]), "float32"), examples, d, batch_tokens=64, shard_tokens=100,
                            progress=False)


def test_feature_cache_refuses_logit_scaling(tmp_path):
    target = tiny_target("granite")  # logits_scaling: logits are the head output divided by 4
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), [1] * n) for n in (7, 9, 5)]
    with pytest.raises(AnchorspecError, match="outside the LM head"):
        build_feature_cache(target, examples, tmp_path / "g", batch_tokens=64, progress=False)
    assert not list((tmp_path / "g").glob("shard-*"))
    llama = tiny_target("llama")  # the same call passes for a plain head
    build_feature_cache(llama, examples, tmp_path / "l", batch_tokens=64, progress=False)
    assert len(FeatureCache(tmp_path / "l", examples)) == 3


# --------------------------------------------------------------------------------------------------
# 6. ttt_forward in draft space
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_target_in_draft_matches_full_logits(variant):
    gen = torch.Generator().manual_seed(1)
    V, H, VD, B, T, K = VOCAB, 32, 40, 3, 12, 4
    d = init_drafter(tiny_config("llama"), variant, draft_vocab_size=VD, init_std=0.2, seed=3)
    d.set_vocab_mapping(torch.randperm(V, generator=gen)[:VD])
    d = d.to(torch.float64)
    d.bind_target_embedding(torch.randn(V, H, generator=gen, dtype=torch.float64))
    aux = torch.randn(B, T, 3 * H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=gen)
    Z = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    boost = torch.rand(B, T, generator=gen) < 0.6  # most, not all, target argmaxes in the draft vocabulary
    Z[boost, d.draft_to_target[torch.randint(0, VD, (B, T), generator=gen)][boost]] += 8
    mask = (torch.rand(B, T, generator=gen) < 0.8).long()
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 9:] = 0
    full = ttt_forward(d, aux, ids, Z, mask, K, pad)
    in_draft = d.t2d[Z.argmax(-1)]
    assert in_draft.any() and not in_draft.all()
    part = ttt_forward(d, aux, ids, Z[..., d.draft_to_target], mask, K, pad, target_in_draft=in_draft)
    assert torch.equal(part.valid_per_step, full.valid_per_step) and int(full.valid_per_step.sum()) > 0
    torch.testing.assert_close(part.loss, full.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(part.loss_per_step, full.loss_per_step, atol=1e-12, rtol=0)
    assert torch.equal(part.acc_per_step, full.acc_per_step)
    # dropping the representability mask changes the result (the argument is really used)
    loose = ttt_forward(d, aux, ids, Z[..., d.draft_to_target], mask, K, pad, target_in_draft=torch.ones_like(in_draft))
    assert int(loose.valid_per_step.sum()) > int(full.valid_per_step.sum())
    with pytest.raises(AnchorspecError, match="draft vocabulary"):
        ttt_forward(d, aux, ids, Z, mask, K, pad, target_in_draft=in_draft)


def test_cli_prepare_only_then_convert_to_bfloat16(setup, tmp_path, capsys):
    """`train --prepare-only` builds the cache and trains nothing; `convert-drafter` re-saves in bf16."""
    from anchorspec.cli import main
    from anchorspec.models.drafter import load_drafter

    target_dir, data = setup
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--max-steps", "2",
              "--ttt-steps", "2", "--draft-vocab-size", str(DRAFT_VOCAB), "--max-len", "64", "--batch-tokens", "64",
              "--dtype", "float32", "--eval-prompts", "0", "--no-progress", "--feature-cache", str(cache)]
    assert main(common + ["--prepare-only"]) == 0
    assert json.loads((cache / "index.json").read_text())["num_examples"] == N_CONVS
    assert not (out / "checkpoints").exists()
    assert main(common) == 0
    capsys.readouterr()
    assert main(["convert-drafter", str(out / "final"), "--out", str(tmp_path / "bf16")]) == 0
    assert "bfloat16" in capsys.readouterr().out
    full, half = load_drafter(out / "final"), load_drafter(tmp_path / "bf16", torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for (name, a), (_, b) in zip(full.state_dict().items(), half.state_dict().items()):
        if a.is_floating_point():
            assert b.dtype == torch.bfloat16
            assert torch.allclose(a, b.float(), rtol=1e-2, atol=1e-3), name
        else:
            assert torch.equal(a, b), name
    assert main(["convert-drafter", str(out / "final"), "--out", str(out / "final")]) == 2


def test_mapped_shards_read_what_safetensors_wrote(tmp_path):
    from safetensors.torch import load_file, save_file

    from anchorspec.train.features import map_safetensors

    tensors = {"aux": torch.randn(7, 5).to(torch.bfloat16), "argmax": torch.arange(7, dtype=torch.int32),
               "hidden": torch.randn(7, 3), "offsets": torch.tensor([0, 3, 7]), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "s.safetensors", metadata={"note": "x"})
    mapped, loaded = map_safetensors(tmp_path / "s.safetensors"), load_file(tmp_path / "s.safetensors")
    assert set(mapped) == set(tensors)
    for k, t in tensors.items():
        assert mapped[k].dtype == t.dtype and mapped[k].shape == t.shape and torch.equal(mapped[k], loaded[k]), k
    # views of one mapping of the file, not copies: the tensors lie as far apart as their bytes in the file
    import json
    raw = (tmp_path / "s.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    apart = header["hidden"]["data_offsets"][0] - header["aux"]["data_offsets"][0]
    assert mapped["hidden"].data_ptr() - mapped["aux"].data_ptr() == apart != 0


def test_eval_heldout_scores_a_spread_subset(setup, tmp_path):
    """--eval-heldout N: the accuracy reads N held-out conversations spread over the split (each batch the
    evaluation builds holds only those), and N >= the split scores what 0 (all) scores."""
    t = Trainer(config(setup, tmp_path / "ev", heldout=0.25, max_steps=1))
    held = t.held_idx
    assert len(held) >= 6
    seen = []
    real_batch = t._batch

    def recording(indices):
        seen.extend(indices)
        return real_batch(indices)

    t._batch = recording
    full = t.evaluate()
    assert sorted(seen) == sorted(held) and full["heldout_scored"] == len(held)

    t.cfg.eval_heldout = 3
    picked = t.scored_heldout()
    assert len(set(picked)) == 3 and set(picked) <= set(held)
    assert picked[0] == held[0] and held.index(picked[-1]) >= len(held) // 2  # spread, not the first three
    seen.clear()
    part = t.evaluate()
    assert sorted(seen) == sorted(picked) and part["heldout_scored"] == 3

    t.cfg.eval_heldout = len(held) + 5
    assert t.scored_heldout() == list(held) and t.evaluate()["heldout_acc"] == full["heldout_acc"]
    with pytest.raises(AnchorspecError, match="--eval-heldout"):
        config(setup, tmp_path / "bad", eval_heldout=-1).validate()


def test_fit_gap_scores_training_conversations_with_the_held_out_scorer(setup, tmp_path):
    """The fit gap's training figures come from a spread subset of the training split, as many as the
    evaluation scores held out, through the very scorer the held-out accuracy uses: scoring the held-out
    conversations as if they were the training ones gives a gap of exactly zero, and training long on a few
    conversations at a high learning rate opens a positive one (memorised, not learned)."""
    t = Trainer(config(setup, tmp_path / "fit", heldout=0.25, max_steps=1, eval_heldout=4))
    train, held = t.scored_train(), t.scored_heldout()
    assert len(train) == len(held) == 4 and set(train) <= set(t.train_idx) and not set(train) & set(t.held_idx)
    assert train[0] == t.train_idx[0] and t.train_idx.index(train[-1]) >= len(t.train_idx) // 2
    fit = t.fit_gap()
    assert fit["heldout_acc"] == t.evaluate()["heldout_acc"] and fit["scored"] == 4
    t.train_idx = list(t.held_idx)  # the same conversations on both sides
    assert t.fit_gap()["gap"] == [0.0] * 3
    assert t.drafter.training  # scoring leaves the drafter in training mode

    # memorising: 2 training conversations (a 90 % split leaves the minimum), many steps at a high learning rate
    m = Trainer(config(setup, tmp_path / "mem", heldout=0.9, max_steps=60, lr=1e-2, dtype="float32"))
    m.run()
    gap = json.loads((tmp_path / "mem" / "run.json").read_text())["summary"]["fit"]["gap"]
    assert gap[0] > 0.05, gap
