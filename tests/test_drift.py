"""Attention-drift diagnostic: attention shares, fed-back RMS, acceptance, chains = EagleProposer's, CLI."""

import json
from collections import Counter

import pytest
import torch

from anchorspec import cli
from anchorspec.api import attach_drafter
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from anchorspec.diagnose import measure_drift
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import init_drafter, save_drafter
from helpers import save_tiny_chat_target, tiny_target

DEPTH, NEW = 5, 14
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [20 + i for i in range(11)], [1]]  # [1]: a one-token prompt


def drafter_for(target, variant, seed=1, **kw):
    return init_drafter(target.config, variant, seed=seed, **kw).to(torch.float64)


@pytest.fixture(scope="module")
def setup(one_thread):
    target = tiny_target("llama")
    drafters = {v: drafter_for(target, v) for v in ("eagle3", "eagle3.1")}
    with torch.no_grad():  # a norm weight of 0.5: post-norm RMS must be 0.5, not 1
        drafters["eagle3.1"].norm.weight.fill_(0.5)
    results = {v: measure_drift(target, d, PROMPTS, depth=DEPTH, positions_per_prompt=3, new_tokens=NEW)
               for v, d in drafters.items()}
    return target, drafters, results


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_attention_shares(setup, variant):
    r = setup[2][variant]
    assert r["num_samples"] == len(r["chains"]) > 0 and r["num_prompts"] == len(PROMPTS)
    assert r["config"]["variant"] == variant and len(r["attn_own"]) == DEPTH
    for sink, ctx, own in zip(r["attn_sink"], r["attn_context"], r["attn_own"]):
        assert all(0 <= x <= 1 + 1e-6 for x in (sink, ctx, own))
        assert sink <= ctx + 1e-9
        assert ctx + own == pytest.approx(1, abs=1e-6)  # the drafter's softmax runs in float32
    assert r["attn_own"][0] == 0  # depth 1's query is the last real position: nothing drafted yet
    assert r["attn_own"][-1] > 0


def _reference_run(target, drafter, prompt):
    attach_drafter(target, drafter)
    ids = torch.tensor(prompt)
    seq = torch.cat([ids, torch.tensor(generate_vanilla(target, ids, GenerationConfig(NEW)).token_ids)])
    aux = target.forward(seq, torch.arange(seq.numel()), target.new_cache(), capture_aux=True).aux
    return seq, aux


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_chains_equal_eagle_proposer(setup, variant):
    """Same state, fed in one update (not the diagnostic's incremental ones), plain SDPA attention."""
    target, drafters, results = setup
    drafter = drafters[variant]
    seen = set()
    for chain in results[variant]["chains"]:
        p, n = chain["prompt"], chain["position"]
        seq, aux = _reference_run(target, drafter, PROMPTS[p])
        assert len(PROMPTS[p]) - 1 <= n and n + DEPTH < seq.numel()  # reference = the target's own answer
        assert chain["reference"] == seq[n + 1:n + 1 + DEPTH].tolist()
        proposer = EagleProposer(drafter)
        proposer.update(seq[:n + 1], aux[:n])
        tree = proposer.propose(TreeShape.chain(DEPTH), SamplingParams(), None)
        assert chain["drafts"] == tree.tokens[1:].tolist()
        seen.add(p)
    assert seen == set(range(len(PROMPTS)))


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_acceptance_is_cumulative_and_recomputable(setup, variant):
    r = setup[2][variant]
    m = r["num_samples"]
    counts = [sum(all(c["drafts"][j] == c["reference"][j] for j in range(d)) for c in r["chains"])
              for d in range(1, DEPTH + 1)]
    assert r["acceptance"] == pytest.approx([c / m for c in counts])
    assert all(a >= b for a, b in zip(r["acceptance"], r["acceptance"][1:]))
    assert r["mean_accepted"] == pytest.approx(sum(counts) / m)
    for d, cond in enumerate(r["conditional_acceptance"]):
        before = m if d == 0 else counts[d - 1]
        assert cond == (counts[d] / before if before else None)


def test_known_acceptance_with_a_one_token_drafter(setup, one_thread):
    """A drafter whose vocabulary is one token X drafts X everywhere: acceptance at depth d is the share
    of points whose next d answer tokens are all X, which we know from the references alone."""
    target, _, results = setup
    refs = [c["reference"] for c in results["eagle3"]["chains"]]
    x = Counter(ref[0] for ref in refs).most_common(1)[0][0]
    drafter = drafter_for(target, "eagle3", draft_vocab_size=1)
    drafter.set_vocab_mapping(torch.tensor([x]))
    r = measure_drift(target, drafter, PROMPTS, depth=DEPTH, positions_per_prompt=3, new_tokens=NEW)
    assert all(c["drafts"] == [x] * DEPTH for c in r["chains"])
    expect = [sum(all(t == x for t in ref[:d]) for ref in refs) / len(refs) for d in range(1, DEPTH + 1)]
    assert r["acceptance"] == pytest.approx(expect) and expect[0] > 0


def test_fed_back_rms_post_norm_vs_raw(setup):
    r3, r31 = setup[2]["eagle3"], setup[2]["eagle3.1"]
    assert r3["hidden_rms"] == r3["raw_hidden_rms"]  # EAGLE-3 feeds back the raw h
    # EAGLE-3.1 feeds back norm(h) = w * h / rms(h): RMS = |w| = 0.5 whatever h's size.
    assert r31["hidden_rms"] == pytest.approx([0.5] * DEPTH, rel=1e-3)
    assert r31["raw_hidden_rms"] != pytest.approx(r31["hidden_rms"], rel=1e-2)
    assert all(abs(a - 0.5) > 0.05 for a in r3["hidden_rms"])


def test_bad_arguments(setup):
    target, drafters, _ = setup
    for kw in ({"depth": 0}, {"positions_per_prompt": 0}, {"sink_tokens": 0}, {"depth": 8, "new_tokens": 4}):
        with pytest.raises(AnchorspecError):
            measure_drift(target, drafters["eagle3"], PROMPTS, **kw)


# --- CLI ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    target_dir = save_tiny_chat_target(root / "target")
    cfg = tiny_target("llama").config
    save_drafter(init_drafter(cfg, "eagle3", seed=1), root / "d3")
    save_drafter(init_drafter(cfg, "eagle3.1", seed=2, aux_layer_ids=[1, 2, 4]), root / "d31")  # other aux layers
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{j}" for j in range(i, i + 4))}) + "\n"
                               for i in range(5)))
    return root, target_dir, prompts


def run_drift(capsys, *argv):
    code = cli.main(["drift", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_writes_json_and_png(capsys, one_thread, cli_files):
    root, target_dir, prompts = cli_files
    out, png = root / "drift.json", root / "drift.png"
    code, stdout, err = run_drift(capsys, "--target", target_dir, "--drafter", f"e3={root / 'd3'}",
                                  "--drafter", f"e31={root / 'd31'}", "--prompts", prompts, "--limit", 3,
                                  "--depth", 3, "--positions", 2, "--new-tokens", 10, "--chat",
                                  "--threads", 1, "--out", out, "--plot", png)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert list(report["drafters"]) == ["e3", "e31"]
    e3, e31 = report["drafters"]["e3"], report["drafters"]["e31"]
    assert e3["config"]["variant"] == "eagle3" and e31["config"]["norm_output"] is True
    assert e3["config"]["aux_layer_ids"] == [2, 3, 3] and e31["config"]["aux_layer_ids"] == [1, 2, 4]
    assert e3["num_prompts"] == 3 and len(e31["acceptance"]) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(stdout.strip().splitlines()[-1])["out"] == str(out)


@pytest.mark.parametrize("case", ["no-equals", "empty-name", "missing-dir", "duplicate", "depth-0",
                                  "new-tokens<depth", "missing-prompts", "out-is-dir"])
def test_cli_bad_input_exit_2_one_line(capsys, tmp_path, cli_files, case):
    root, target_dir, prompts = cli_files
    drafters = ["--drafter", f"a={root / 'd3'}"]
    extra, out = [], tmp_path / "o.json"
    if case == "no-equals":
        drafters = ["--drafter", str(root / "d3")]
    elif case == "empty-name":
        drafters = ["--drafter", f"={root / 'd3'}"]
    elif case == "missing-dir":
        drafters = ["--drafter", f"a={root / 'nowhere'}"]
    elif case == "duplicate":
        drafters += ["--drafter", f"a={root / 'd31'}"]
    elif case == "depth-0":
        extra = ["--depth", "0"]
    elif case == "new-tokens<depth":
        extra = ["--depth", "8", "--new-tokens", "4"]
    elif case == "missing-prompts":
        prompts = tmp_path / "missing.jsonl"
    elif case == "out-is-dir":
        out = tmp_path
    code, stdout, err = run_drift(capsys, "--target", target_dir, *drafters, "--prompts", prompts, *extra,
                                  "--out", out)
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorspec: error:"), err
    expect = {"no-equals": "NAME=DIR", "empty-name": "NAME=DIR", "missing-dir": "nowhere", "duplicate": "distinct",
              "depth-0": "--depth", "new-tokens<depth": "--new-tokens", "missing-prompts": "missing.jsonl",
              "out-is-dir": "directory"}[case]
    assert expect in lines[0]
    assert not (tmp_path / "o.json").exists()
