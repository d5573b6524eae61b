"""The acceptance-maximising second stage (`train --stage accept`, anchorspec/train/accept.py): the
reward equals the verifier's accepted length on hand-built cases; the on-policy chains and the
target's scores equal plain decoding (float64); the stage raises the held-out expected accepted
length of a distilled drafter more than continuing distillation does; the trainer's refusals."""

from __future__ import annotations

import pytest
import torch

from anchorspec.api import attach_drafter
from anchorspec.decode.tree import DraftTree
from anchorspec.decode.verify import verify_greedy
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import KVCache, init_drafter
from anchorspec.train.accept import (acceptance_rates, choose_slots, draft_chains, expected_accepted_length,
                                     greedy_accepted_length, score_chains)
from anchorspec.train.trainer import Trainer
from helpers import VOCAB, tiny_target
from train_world import config, read_jsonl, setup  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def chain_tree(root: int, drafts: list[int]) -> DraftTree:
    return DraftTree(torch.tensor([root] + drafts), list(range(-1, len(drafts))))


@pytest.mark.parametrize("drafts, choices", [
    ([3, 4, 5, 6], [3, 4, 5, 6, 7]),  # all accepted
    ([3, 4, 5, 6], [9, 4, 5, 6, 7]),  # first rejected
    ([3, 4, 5, 6], [3, 4, 8, 6, 7]),  # rejected at depth 3, later "matches" do not count
    ([3, 3, 3], [3, 3, 2, 3]),
    ([1], [1, 0]),
])
def test_reward_equals_the_verifiers_accepted_length(drafts, choices):
    """With one-hot target and drafter distributions, E = sum_k prod alpha equals what verify_greedy
    accepts on the same chain, and so does the greedy count."""
    V = 10
    K = len(drafts)
    logits = torch.full((K + 1, V), -30.0, dtype=torch.float64)  # row i: the target after node i
    logits[torch.arange(K + 1), torch.tensor(choices)] = 0.0
    verdict = verify_greedy(chain_tree(0, drafts), logits)
    p = logits[:K].softmax(-1)  # the target's distribution at depth k = after node k-1
    q = torch.nn.functional.one_hot(torch.tensor(drafts), V).double()
    alpha = acceptance_rates(p, q)
    assert abs(float(expected_accepted_length(alpha)) - verdict.accepted) < 1e-9
    assert int(greedy_accepted_length(torch.tensor(drafts), torch.tensor(choices[:K]))) == verdict.accepted


def test_acceptance_rate_is_one_minus_total_variation():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    assert abs(float(acceptance_rates(p, q)) - (0.2 + 0.2 + 0.2)) < 1e-12
    assert abs(float(acceptance_rates(p, q)) - (1 - 0.5 * float((p - q).abs().sum()))) < 1e-12
    # target mass outside the draft vocabulary is never accepted (p is not renormalised)
    assert abs(float(acceptance_rates(torch.tensor([0.4, 0.1]), torch.tensor([0.5, 0.5]))) - 0.5) < 1e-7
    alpha = torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64)
    assert abs(float(expected_accepted_length(alpha)) - (0.5 + 0.25 + 0.25)) < 1e-12


def test_choose_slots():
    ids = torch.zeros(2, 8, dtype=torch.long)
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
    pad = torch.tensor([[1] * 8, [1] * 7 + [0]])
    slots, valid = choose_slots(ids, lm, pad, 3)
    assert valid[0].all() and slots[0].tolist() == [1, 3, 6]  # x_{t+2} or x_{t+1} in the answer, t+1 real
    assert slots[1].tolist()[:2] == [4, 5] and valid[1].tolist() == [True, True, False]


@pytest.mark.parametrize("layers", [1, 2])
def test_on_policy_chains_and_scores_equal_plain_decoding(layers):
    """Each chosen slot's chain is the drafter's greedy chain drafted step by step on a KVCache, with
    the same logits; the target's scores equal a plain forward over context + chain (float64)."""
    target = tiny_target("llama")
    d = init_drafter(target.config, "eagle3.1", draft_vocab_size=64, seed=1, init_std=0.2,
                     num_layers=layers).to(torch.float64)
    attach_drafter(target, d)
    gen = torch.Generator().manual_seed(0)
    B, T, K = 2, 12, 4
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 9:] = 0
    feats = target.features(ids, pad)
    slots, valid = choose_slots(ids, torch.ones(B, T, dtype=torch.long), pad, 3)
    assert valid.all() and int(slots[1].max()) <= 7
    drafted, logits = draft_chains(d, feats.aux, ids, slots, K, pad)
    scores = score_chains(target, ids, pad, slots, drafted)
    assert scores.shape == (B, 3, K - 1, VOCAB)
    for b in range(B):
        for s in range(3):
            t = int(slots[b, s])
            cache = KVCache()
            with torch.no_grad():
                st = d.step(ids[b:b + 1, 1:t + 2], d.project_features(feats.aux[b:b + 1, :t + 1]),
                            torch.arange(t + 1)[None], cache)
                tokens = []
                for k in range(K):
                    x = st.next_hidden[0, -1]
                    ref = d.lm_head(x if d.config.norm_output else d.norm(x))
                    torch.testing.assert_close(logits[b, s, k].detach(), ref, atol=1e-10, rtol=0)
                    tokens.append(int(d.draft_to_target[ref.argmax()]))
                    st = d.step(torch.tensor([[tokens[-1]]]), st.next_hidden[:, -1:], torch.tensor([[t + 1 + k]]),
                                cache)
                full = target.model(torch.cat([ids[b, :t + 2], torch.tensor(tokens[:-1])])[None]).logits[0]
            assert drafted[b, s].tolist() == tokens
            torch.testing.assert_close(scores[b, s], full[t + 2:], atol=1e-10, rtol=0)


def test_stage_accept_raises_heldout_expected_acceptance_beyond_distillation(setup, tmp_path):  # noqa: F811
    """A drafter distilled for 200 steps, then 40 more steps of either stage from it: --stage accept
    raises the held-out expected accepted length of the drafter's own chains clearly, and by more
    than continuing distillation does (which has nearly converged)."""
    Trainer(config(setup, tmp_path / "d", max_steps=200, eval_every=1000)).run()

    def second(stage):
        t = Trainer(config(setup, tmp_path / stage, max_steps=40, init_from=str(tmp_path / "d" / "final"),
                           variant=None, draft_vocab_size=None, stage=stage, eval_every=1000))
        start = t.heldout_acceptance()["heldout_expected_accept_len"]
        t.run()
        return start, t.heldout_acceptance()

    start, accept = second("accept")
    start2, distill = second("distill")
    assert start == start2
    gain_accept = accept["heldout_expected_accept_len"] - start
    gain_distill = distill["heldout_expected_accept_len"] - start
    assert gain_accept > 0.1, (start, accept)
    assert gain_accept > 2 * max(gain_distill, 0.0) + 0.05, (gain_accept, gain_distill)
    recs = [r for r in read_jsonl(tmp_path / "accept" / "metrics.jsonl") if "loss" in r]
    assert all(abs(r["expected_accept_len"] + r["loss"]) < 1e-9 for r in recs)  # loss = -E
    assert recs[-1]["expected_accept_len"] > recs[0]["expected_accept_len"]


def test_stage_accept_refusals(setup, tmp_path):  # noqa: F811
    with pytest.raises(AnchorspecError, match="second stage.*--init-from"):
        Trainer(config(setup, tmp_path / "a", stage="accept"))
    with pytest.raises(AnchorspecError, match="--stage must be"):
        Trainer(config(setup, tmp_path / "b", stage="rl"))
    for kw, pattern in ((dict(feature_cache=str(tmp_path / "c")), "drop --feature-cache"),
                        (dict(attn_align=1.0), "--attn-align applies")):
        with pytest.raises(AnchorspecError, match=pattern):
            Trainer(config(setup, tmp_path / "x", stage="accept", init_from=str(tmp_path), variant=None,
                           draft_vocab_size=None, **kw))
