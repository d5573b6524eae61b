"""Attention alignment (`train --attn-align`, anchorspec/train/attn_align.py): the target probe equals
the eager attention and changes no output; the position mapping; the loss is zero when the maps
match and a gradient step moves the drafter's map toward the target's; the trainer option."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import init_drafter
from anchorspec.models.target import Target
from anchorspec.train.attn_align import attention_alignment_loss, target_attention, target_slot_map
from anchorspec.train.trainer import Trainer
from anchorspec.train.ttt import ttt_forward
from helpers import VOCAB, tiny_config, tiny_target
from train_world import config, read_jsonl, setup  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(B=2, T=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, T - 3:] = 0  # right padding
    return ids, pad


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_probe_equals_eager_attention_and_changes_nothing(family):
    target = tiny_target(family)
    ids, pad = batch()
    layer = 3
    plain = target.features(ids, pad)
    feats, amap = target_attention(target, ids, pad, layer)
    assert torch.equal(feats.logits, plain.logits) and torch.equal(feats.aux, plain.aux)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="eager")
    eager = eager.to(torch.float64).eval()
    eager.load_state_dict(target.model.state_dict())
    with torch.no_grad():
        maps = eager(input_ids=ids, attention_mask=pad, output_attentions=True).attentions
        ref, other = maps[layer].mean(1), maps[layer - 1].mean(1)
    real = pad.bool()
    for b in range(ids.shape[0]):
        n = int(real[b].sum())
        # HF's eager softmax runs in fp32 whatever the dtype: 1e-6, far below the next layer's difference
        torch.testing.assert_close(amap[b, :n, :n], ref[b, :n, :n], atol=1e-6, rtol=0)
        assert (amap[b, :n, :n] - other[b, :n, :n]).abs().max() > 1e-3
    torch.testing.assert_close(amap.sum(-1), torch.ones_like(amap.sum(-1)), atol=1e-12, rtol=0)
    assert target.model.model.layers[layer].self_attn.config is target.model.config  # restored


def test_slot_map_by_hand():
    """Row t = the target's query at position t+1; key j -> slot j; key t+1 joins slot t."""
    P = torch.zeros(1, 4, 4, dtype=torch.float64)
    P[0, 0, 0] = 1
    P[0, 1, :2] = torch.tensor([0.7, 0.3])
    P[0, 2, :3] = torch.tensor([0.5, 0.2, 0.3])
    P[0, 3, :4] = torch.tensor([0.4, 0.1, 0.2, 0.3])
    expected = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.4, 0.1, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(target_slot_map(P)[0], expected)


def _drafter_and_inputs(seed=0):
    target = tiny_target("llama")
    d = init_drafter(target.config, "eagle3.1", draft_vocab_size=64, seed=seed, init_std=0.2).to(torch.float64)
    d.bind_target_embedding(target.embed_weight)
    ids, pad = batch(seed=seed)
    feats, amap = target_attention(target, ids, pad, max(target.aux_layer_ids))
    Z = feats.logits[..., d.draft_to_target]
    in_draft = d.t2d[feats.logits.argmax(-1)]
    return target, d, (feats.aux, ids, Z, torch.ones_like(ids), 3, pad, False, in_draft), amap


def _ttt(d, inputs, amap, weight=1.0):
    aux, ids, Z, lm, K, pad, _, in_draft = inputs
    return ttt_forward(d, aux, ids, Z, lm, K, pad, target_in_draft=in_draft, target_attn=amap, attn_align=weight)


def test_loss_is_zero_when_the_maps_match_and_positive_otherwise():
    _, d, inputs, amap = _drafter_and_inputs()
    with torch.no_grad():
        D = _ttt(d, inputs, amap).drafter_attn  # [B, T, T] the drafter's own step-0 map
    B, T, _ = D.shape
    # a target map whose slot map is exactly D: row t+1 puts D[t] on keys 0..t, nothing on key t+1
    P = torch.zeros(B, T, T, dtype=D.dtype)
    P[:, 0, 0] = 1
    P[:, 1:, :T - 1] = D[:, :T - 1, :T - 1]
    with torch.no_grad():
        same = _ttt(d, inputs, P)
        other = _ttt(d, inputs, amap)
    assert abs(float(same.attn_loss)) < 1e-12
    assert float(other.attn_loss) > 1e-3
    plain = ttt_forward(d, *[x for x in inputs[:5]], inputs[5], target_in_draft=inputs[7])
    torch.testing.assert_close(other.loss, plain.loss + 1.0 * other.attn_loss)  # loss = CE + weight * KL


def test_a_gradient_step_moves_the_drafter_map_toward_the_target():
    _, d, inputs, amap = _drafter_and_inputs(seed=1)
    out = _ttt(d, inputs, amap)
    before, map_before = float(out.attn_loss.detach()), out.drafter_attn.detach()
    d.zero_grad()
    out.attn_loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    assert any(n.startswith("midlayer.self_attn.q_proj") for n in grads) and "fc.weight" in grads
    assert "lm_head.weight" not in grads  # the term reaches only what forms the attention
    params = dict(d.named_parameters())

    def moved(sign):
        with torch.no_grad():
            for n, g in grads.items():
                params[n].sub_(sign * 0.5 * g)
            res = _ttt(d, inputs, amap)
            for n, g in grads.items():
                params[n].add_(sign * 0.5 * g)
        return float(res.attn_loss), res.drafter_attn

    after, map_after = moved(+1)
    assert after < before * 0.99
    rows = target_slot_map(amap)
    T = rows.shape[1]
    dist = lambda m: (m[:, :T, :T] - rows).abs().sum()  # noqa: E731 - L1 distance to the target's map
    assert dist(map_after) < dist(map_before)
    assert moved(-1)[0] > before  # negative control: the opposite step moves away


def test_loss_ignores_rows_that_are_not_scored():
    D = torch.full((1, 4, 4), 0.25, dtype=torch.float64).tril()
    D = D / D.sum(-1, keepdim=True)
    P = torch.eye(4, dtype=torch.float64)[None]
    none = attention_alignment_loss(D, P, torch.zeros(1, 2, dtype=torch.bool))
    some = attention_alignment_loss(D, P, torch.tensor([[False, True]]))
    assert float(none) == 0.0 and float(some) > 0


def test_trainer_attn_align(setup, tmp_path):  # noqa: F811
    with pytest.raises(AnchorspecError, match="--attn-align needs online target features"):
        Trainer(config(setup, tmp_path / "x", attn_align=1.0, feature_cache=str(tmp_path / "cache")))
    with pytest.raises(AnchorspecError, match="--attn-align must be >= 0"):
        Trainer(config(setup, tmp_path / "y", attn_align=-1.0))
    cfg = config(setup, tmp_path / "a", attn_align=5.0, max_steps=8, ttt_steps=2)
    Trainer(cfg).run()
    kl = [r["attn_align_kl"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert len(kl) == 8 and kl[-1] < kl[0] * 0.9
    # the default run logs no such term
    Trainer(dataclasses.replace(cfg, out=str(tmp_path / "b"), attn_align=0.0, max_steps=1)).run()
    assert all("attn_align_kl" not in r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl"))
