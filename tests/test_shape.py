"""Draft-shape selection: replayed acceptance equals real speculative decoding, cost profile, the
profile on disk, `anchorspec tune` and the default shape of generate."""

import json

import pytest
import torch
from transformers import AutoConfig

from anchorspec import cli, load
from anchorspec.api import attach_drafter
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.fallback import TREE_CANDIDATES
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import (accepted_length, captured_states, estimate_shapes, load_profile_shape,
                                     profile_path, replay, save_profile, verify_cost)
from anchorspec.decode.tree import DraftTree, TreeShape
from anchorspec.models.drafter import init_drafter, save_drafter
from helpers import CHAT_WORDS, OracleProposer, save_tiny_chat_target, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 24
PROMPTS = [[3, 4, 5, 6, 7], [9, 10, 11], [20 + i for i in range(9)]]


def test_accepted_length_follows_matching_branches():
    # root 0 -> (1: token 5), (2: token 6); 1 -> (3: token 7); 2 -> (4: token 8) -> (5: token 9)
    tree = DraftTree(torch.tensor([0, 5, 6, 7, 8, 9]), [-1, 0, 0, 1, 2, 4])
    assert accepted_length(tree, [5, 7, 1]) == 2
    assert accepted_length(tree, [6, 8, 9, 4]) == 3
    assert accepted_length(tree, [6, 7]) == 1  # 7 hangs under the other branch
    assert accepted_length(tree, [4]) == 0


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    drafter = init_drafter(target.config, "eagle3.1", seed=3).to(torch.float64)
    attach_drafter(target, drafter)
    return target, EagleProposer(drafter)


def _sequences(target):
    cfg = GenerationConfig(max_new_tokens=NEW)  # no stop tokens: every answer is NEW long
    return [(torch.tensor(p + generate_vanilla(target, torch.tensor(p), cfg).token_ids), len(p)) for p in PROMPTS]


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(2, 3, 6), TreeShape(4, 4, 12)])
def test_replay_equals_real_speculative_decoding(setup, shape):
    """float64: the replayed walk takes exactly the steps real greedy speculation takes."""
    target, proposer = setup
    for (seq, plen), prompt in zip(_sequences(target), PROMPTS):
        replayed = replay(target, proposer, seq, plen, shape)
        real = generate_speculative(target, proposer, torch.tensor(prompt), GenerationConfig(max_new_tokens=NEW), shape)
        again = replay(target, proposer, seq, plen, shape, aux=captured_states(target, seq))  # states given: the same
        assert again.accepted_per_depth == replayed.accepted_per_depth and again.verify_steps == replayed.verify_steps
        assert replayed.verify_steps == real.stats.verify_steps > 0
        assert replayed.accepted_tokens == real.stats.accepted_tokens
        assert replayed.drafted_tokens == real.stats.drafted_tokens
        assert replayed.accepted_per_depth == real.stats.accepted_per_depth
        assert replayed.reached_per_depth == real.stats.reached_per_depth


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_replayed_chains_are_what_ttt_predicts(variant):
    """float64: at every root the engine drafts from, the chain it drafts is TTT's slot root-1, token
    for token up to the first miss (past it, TTT feeds the true token and inference its own), so a
    held-out TTT accuracy measures the very drafts `generate` makes (benchmarks/ttt_vs_replay.py)."""
    from anchorspec.train.ttt import ttt_forward

    target = tiny_target("llama")
    drafter = init_drafter(target.config, variant, seed=5).to(torch.float64)
    attach_drafter(target, drafter)
    proposer, K = EagleProposer(drafter), 4
    checked = 0
    for seq, plen in _sequences(target):
        roots = []
        replay(target, proposer, seq, plen, TreeShape.chain(K), roots=roots)
        with torch.no_grad():
            feats = target.features(seq[None])
            mask = torch.zeros(1, seq.numel(), dtype=torch.long)
            mask[0, plen:] = 1
            out = ttt_forward(drafter, feats.aux, seq[None], feats.logits[..., drafter.draft_to_target], mask, steps=K,
                              return_logits=True, target_in_draft=drafter.t2d[feats.logits.argmax(-1)])
        pred = drafter.draft_to_target[out.logits[:, 0].argmax(-1)]  # [K, T]: target ids
        assert [r[0] for r in roots][0] == plen and len(roots) > 2
        for pos, accepted, tree in roots:
            chain = tree.tokens[1:].tolist()
            assert len(chain) == tree.depth and accepted <= tree.depth
            for k in range(min(accepted + 1, tree.depth)):
                assert chain[k] == int(pred[k, pos - 1]), (pos, k)
                checked += 1
    assert checked > 20


def test_oracle_replay_accepts_everything():
    target = tiny_target("llama")
    seq, plen = _sequences(target)[0]
    stats = replay(target, OracleProposer(target), seq, plen, TreeShape.chain(4))
    assert stats.accepted_tokens == stats.drafted_tokens  # chains: drafted = depth per step
    assert stats.verify_steps == -(-(NEW - 1) // 5)  # (NEW - 1) tokens in steps of up to 5


def test_verify_cost_and_estimates(setup):
    target, proposer = setup
    costs, plain = verify_cost(target, 40, [8, 2, 8], repeats=3)
    assert list(costs) == [2, 8] and plain > 0 and all(c > 0 for c in costs.values())
    shapes = [TreeShape.chain(2), TreeShape(2, 3, 6)]
    estimates, plain_s, context = estimate_shapes(target, proposer, _sequences(target), shapes)
    assert context == int(sum(len(p) + NEW for p in PROMPTS) / len(PROMPTS))  # mean calibration length
    assert [e.tokens_per_s for e in estimates] == sorted((e.tokens_per_s for e in estimates), reverse=True)
    for e in estimates:
        assert 1 <= e.tau <= e.shape[1] + 1 and e.draft_s > 0 and e.verify_s > 0
        assert 1 <= len(e.acceptance_per_depth) <= e.shape[1]  # the deepest level any draft reached


def test_profile_round_trip(tmp_path, monkeypatch, setup):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path))
    target, proposer = setup
    estimates, plain_s, context = estimate_shapes(target, proposer, _sequences(target)[:1], [TreeShape(2, 3, 6)])
    path = profile_path("t", "d", torch.float32)
    assert load_profile_shape("t", "d", torch.float32) is None
    save_profile(path, estimates, plain_s, context, {"x": 1})
    assert load_profile_shape("t", "d", torch.float32) == (TreeShape(2, 3, 6), path)
    assert load_profile_shape("t", "d", torch.bfloat16) is None  # per dtype
    old = torch.get_num_threads()
    torch.set_num_threads(old + 1)
    try:
        assert load_profile_shape("t", "d", torch.float32) is None  # per thread count
    finally:
        torch.set_num_threads(old)
    path.write_text("{not json")
    assert load_profile_shape("t", "d", torch.float32) is None  # damaged: ignored


def test_tune_cli_then_generate_uses_the_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))
    target = save_tiny_chat_target(tmp_path / "target", dtype=torch.float64)
    save_drafter(init_drafter(AutoConfig.from_pretrained(target), "eagle3.1", draft_vocab_size=64, seed=1),
                 tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(CHAT_WORDS[i:i + 4])}) + "\n" for i in range(3)))
    common = ["--target", str(target), "--drafter", str(tmp_path / "drafter"), "--dtype", "float64"]
    engine = load(str(target), str(tmp_path / "drafter"), "float64")
    measured = engine.shape  # no profile: the chain or tree the measured costs favour (decode/fallback.py)
    assert (measured.is_chain or measured in TREE_CANDIDATES) and engine.shape_source.startswith("measured")
    assert cli.main(["tune", *common, "--prompts", str(prompts), "--new-tokens", "12", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "expected tok/s" in out and "best:" in out
    body = json.loads(next((tmp_path / "home" / "shapes").glob("*.json")).read_text())
    best = TreeShape(*body["best"])
    assert body["estimates"][0]["shape"] == body["best"] and len(body["estimates"]) > 10
    engine = load(str(target), str(tmp_path / "drafter"), "float64")
    assert engine.shape == best and engine.shape_source.startswith("tuned")
    assert load(str(target), str(tmp_path / "drafter"), "float64", shape=TreeShape.chain(2)).shape == TreeShape.chain(2)
    assert cli.main(["generate", *common, "--prompt", "w1 w2", "--chat", "--max-new-tokens", "4"]) == 0
    assert f"[draft shape {best.top_k},{best.depth},{best.total_tokens}: tuned" in capsys.readouterr().err
    assert cli.main(["tune", *common[:2], "--drafter", str(tmp_path / "none")]) == 2


def test_capped_shape():
    assert TreeShape(4, 4, 16).capped(2) == TreeShape(4, 2, 16)
    assert TreeShape(4, 4, 16).capped(9) == TreeShape(4, 4, 16)
    assert TreeShape.chain(5).capped(3) == TreeShape.chain(3)
    assert TreeShape.chain(5).capped(0) is None


def test_load_keeps_costs_per_target_drafter_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))
    target = save_tiny_chat_target(tmp_path / "target", dtype=torch.float64)
    for name, seed in (("d1", 1), ("d2", 2)):
        save_drafter(init_drafter(AutoConfig.from_pretrained(target), "eagle3.1", draft_vocab_size=64, seed=seed),
                     tmp_path / name)
    engine = load(str(target), str(tmp_path / "d1"), "float64")
    assert engine.costs_file.parent == tmp_path / "home" / "costs" and not engine.costs_file.exists()
    engine.shape  # calibrates, and keeps what it measured
    assert engine.costs_file.is_file()
    again = load(str(target), str(tmp_path / "d1"), "float64")
    assert again.costs_file == engine.costs_file and again.monitor.calibrated
    assert load(str(target), str(tmp_path / "d2"), "float64").costs_file != engine.costs_file
    assert load(str(target), str(tmp_path / "d1"), "float32").costs_file != engine.costs_file
    assert load(str(target), str(tmp_path / "d1"), "float64", remember=False).costs_file is None
    monkeypatch.setenv("ANCHORSPEC_REMEMBER", "off")
    assert load(str(target), str(tmp_path / "d1"), "float64").costs_file is None
    assert load(str(target), None, "float64", remember=True).costs_file is None  # no drafter, nothing to learn
