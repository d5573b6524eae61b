"""SmolLM2-135M-Instruct (the real reference target) with a random drafter: speculative output is
identical to plain greedy output on MT-bench prompts, and the CLI speaks JSON.

Marked `realmodel`: it converts the GGUF once (~25 s) into $ANCHORSPEC_HOME. CI runs it too.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA

import anchorspec
from anchorspec import TreeShape, load
from anchorspec.cli import main, read_prompts
from anchorspec.models.drafter import init_drafter, save_drafter

pytestmark = pytest.mark.realmodel
MT_BENCH = SHARED_DATA / "mt_bench" / "question.jsonl"
# A bare clone has no evaluation data: the prompts the project ships (for the demo) stand in for MT-bench.
PROMPTS = MT_BENCH if MT_BENCH.is_file() else Path(anchorspec.__file__).parent / "data" / "demo_prompts.jsonl"


@pytest.fixture(scope="module")
def engine_and_drafter(tmp_path_factory):
    engine = load("smollm2-135m-instruct", dtype="float32")
    drafter_dir = tmp_path_factory.mktemp("drafter")
    save_drafter(init_drafter(engine.target.config, "eagle3.1", draft_vocab_size=8192, seed=0), drafter_dir)
    # fallback off: a random drafter never pays, and these tests are about its drafts being verified
    return load("smollm2-135m-instruct", str(drafter_dir), dtype="float32", fallback=False), drafter_dir


def test_random_drafter_output_identical_to_greedy(engine_and_drafter):
    engine, _ = engine_and_drafter
    prompts = read_prompts(str(PROMPTS))[:3]
    for prompt in prompts:
        ref = engine.generate(prompt, chat=True, max_new_tokens=40, speculative=False)
        assert len(ref.token_ids) > 5
        for shape in (TreeShape.chain(3), TreeShape(8, 6, 32)):
            res = engine.generate(prompt, chat=True, max_new_tokens=40, shape=shape)
            assert res.token_ids == ref.token_ids, (prompt[:40], shape)
            assert res.text == ref.text
            assert res.stats.drafted_tokens > 0


def test_cli_json_output(engine_and_drafter, capsys):
    _, drafter_dir = engine_and_drafter
    code = main(["generate", "--target", "smollm2-135m-instruct", "--drafter", str(drafter_dir), "--prompt",
                 "What is 2+2?", "--chat", "--max-new-tokens", "12", "--chain", "2", "--json",
                 "--no-fallback"])  # a random drafter: the fallback would rightly stop drafting
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(row) >= {"text", "token_ids", "stats"}
    assert 0 < len(row["token_ids"]) <= 12
    stats = row["stats"]
    assert stats["new_tokens"] == len(row["token_ids"])
    # prefill + verifications (+ one plain step when the budget leaves room for a single token)
    assert stats["verify_steps"] + 1 <= stats["target_forwards"] <= stats["verify_steps"] + 2
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert stats["fallback_switches"] == 0
    assert stats["tau"] >= 1.0


RELEASED_DRAFTER = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle3.1"


def test_released_drafter_commits_several_tokens_and_matches_greedy():
    """The released EAGLE-3.1 drafter on the real target, float32: drafts are accepted (multi-token
    commits into the real KV cache) and the output is plain greedy's, token for token."""
    engine = load("smollm2-135m-instruct", str(RELEASED_DRAFTER), dtype="float32", fallback=False)
    accepted = 0
    for prompt in read_prompts(str(PROMPTS))[:2]:
        ref = engine.generate(prompt, chat=True, max_new_tokens=24, speculative=False)
        for shape in (TreeShape.chain(3), TreeShape(4, 3, 10)):
            res = engine.generate(prompt, chat=True, max_new_tokens=24, shape=shape)
            assert res.token_ids == ref.token_ids, (prompt[:40], shape)
            accepted += res.stats.accepted_tokens
            assert res.stats.target_forwards < len(ref.token_ids)  # fewer target forwards than tokens
    assert accepted > 0


def test_committed_corpus_prompts_read_back_with_the_real_template():
    """`regenerate --data corpus/...` answers the committed corpus's prompts again (sampled twins):
    SmolLM2's tokenizer and ChatML template must read every kind of packed prompt back exactly
    (ShareGPT first turns, later turns with their context reply, Magpie prompts)."""
    from transformers import AutoTokenizer

    from anchorspec.data.corpus import iter_packed
    from anchorspec.data.chat import first_answer, messages_from_prompt, prompt_ids, template_markers
    from anchorspec.models.hub import resolve_target

    corpus = Path(__file__).resolve().parents[1] / "corpus" / "smollm2-135m-instruct"
    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    markers, seen = template_markers(tok), {"first": 0, "later": 0}
    assert markers is not None
    for pid, tokens, loss in iter_packed(corpus, vocab_size=tok.vocab_size):
        kind = "later" if pid.endswith("#later") else "first"
        if seen[kind] >= 40:
            if min(seen.values()) >= 40:
                break
            continue
        prompt = tokens[: first_answer(tokens, loss)[1]]
        messages = messages_from_prompt(tok, prompt, markers)
        assert messages is not None and prompt_ids(tok, messages) == prompt, pid
        assert sum(m["role"] == "assistant" for m in messages) == (kind == "later"), pid
        seen[kind] += 1
    assert min(seen.values()) >= 40


def _demo_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "demo.py"
    spec = importlib.util.spec_from_file_location("anchorspec_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO_ARGS = ["--limit", "2", "--max-new-tokens", "16", "--compile", "off", "--dtype", "bfloat16", "--json",
             "--drafter", str(RELEASED_DRAFTER)]


def test_demo_checks_losslessness_in_float32(capsys):
    """The demo's timed run in bfloat16 is followed by the exact check: float32, speculation forced at the
    timed run's shape, every output equal to plain decoding's, with drafts verified."""
    assert _demo_module().main(DEMO_ARGS) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    check = summary["float32_check"]
    assert check["prompts"] == 2 and check["identical_to_plain"] == 2
    assert check["verify_steps"] > 0 and check["tau"] > 1.0


def test_demo_float32_check_catches_a_lossy_verifier(monkeypatch, capsys):
    """Negative control: a verifier that accepts the first drafted path whatever the target says makes the
    float32 check fail, and the demo exits 1."""
    import anchorspec.decode.engine as engine_mod
    from anchorspec.decode.verify import Verdict

    def accept_first_path(tree, logits):
        path = [0]
        while tree.children[path[-1]] and tree.children[path[-1]][0] < logits.shape[0]:
            path.append(tree.children[path[-1]][0])
        return Verdict(path, int(logits[path[-1]].argmax()))

    monkeypatch.setattr(engine_mod, "verify_greedy", accept_first_path)
    assert _demo_module().main([*DEMO_ARGS, "--limit", "1"]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["float32_check"]["identical_to_plain"] == 0
