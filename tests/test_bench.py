"""`anchorspec bench`: workloads, the interleaved runner (float64: every lossless method matches HF
greedy token for token), resume after a crash, the summary math, plots and the CLI."""

import json
import random

import pytest
import torch
from transformers import AutoConfig

from anchorspec import cli
from anchorspec.api import DEFAULT_TREE
from anchorspec.bench import BenchSpec, run_bench
from anchorspec.bench.job import describe_shape
from anchorspec.bench.report import markdown, summarize
from anchorspec.bench.workloads import LONG_SIZES, Prompt, encode, expand_workloads, load_workload
from anchorspec.decode.fallback import MAX_CHAIN, TREE_CANDIDATES
from anchorspec.decode.tree import TreeShape
from anchorspec.errors import AnchorspecError
from anchorspec.metrics import GenerationStats
from anchorspec.models.drafter import init_drafter, save_drafter
from helpers import CHAT_WORDS, save_tiny_chat_target, tiny_chat_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
SUBSETS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum")


def _words(rng, n):
    return " ".join(rng.choice(CHAT_WORDS) for _ in range(n))


def write_data(root):
    """A data folder shaped like ../shared/data, in the tiny tokenizer's words."""
    rng = random.Random(0)
    for sub in SUBSETS:
        folder = root / "eagle_eval" / sub
        folder.mkdir(parents=True)
        rows = [{"question_id": 100 + i, "turns": [_words(rng, 5), _words(rng, 4)] if sub == "mt_bench"
                 else [_words(rng, 6)]} for i in range(4)]
        (folder / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    essays = root / "long_context" / "paul_graham_essays"
    essays.mkdir(parents=True)
    for i in range(3):
        (essays / f"e{i}.txt").write_text("\n".join(_words(rng, 10) for _ in range(40)))
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_chat_target(root / "target", dtype=torch.float64)
    cfg = AutoConfig.from_pretrained(target)
    for variant in ("eagle3", "eagle3.1"):
        save_drafter(init_drafter(cfg, variant, draft_vocab_size=64, seed=1).to(torch.float64), root / variant)
    return {"root": root, "target": str(target), "data": str(write_data(root / "data")),
            "drafters": [("d3", str(root / "eagle3")), ("d31", str(root / "eagle3.1"))]}


def spec(dirs, out, **kw):
    base = dict(target=dirs["target"], drafters=dirs["drafters"], workloads="mt_bench,gsm8k,tpl-plain,long-1k",
                temperatures=(0.0, 1.0), limit=2, max_new_tokens=6, dtype="float64", data_dir=dirs["data"],
                out=str(out), progress=False, fallback=False,  # the drafters' own tau (ratios)
                baselines=("hf", "hf_lookup", "vanilla", "lookup"),
                shape=DEFAULT_TREE)  # fixed: a measured shape follows what the engine learned on earlier prompts
    base.update(kw)
    return BenchSpec(**base)


@pytest.fixture(scope="module")
def bench(dirs):
    out = dirs["root"] / "out"
    summary = run_bench(spec(dirs, out))
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()[1:]]
    return out, summary, records


# --- workloads -----------------------------------------------------------------------------------

def test_expand_workloads():
    assert expand_workloads("standard") == list(SUBSETS)
    assert expand_workloads("long-2k,templates,long-2k")[:2] == ["long-2k", "tpl-default"]
    assert len(expand_workloads("standard,templates,long")) == 6 + 6 + 4
    with pytest.raises(AnchorspecError, match="unknown workload"):
        expand_workloads("standard,mtbench")


def test_template_variants_render_differently(dirs):
    tok = tiny_chat_tokenizer()
    names = ["tpl-default", "tpl-empty-system", "tpl-sys-concise", "tpl-sys-pirate", "tpl-plain"]
    prompts = {n: load_workload(n, 1, tok, dirs["data"])[0] for n in names}
    assert len({p.turns for p in prompts.values()}) == 1  # the same question under every template
    ids = {n: encode(tok, p, []) for n, p in prompts.items()}
    assert len({tuple(v) for v in ids.values()}) == len(names)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert start not in ids["tpl-plain"] and start in ids["tpl-default"]
    assert ids["tpl-empty-system"][:2] == [start, tok.convert_tokens_to_ids("system")]


def test_multi_turn_encoding_carries_answers(dirs):
    tok = tiny_chat_tokenizer()
    p = load_workload("mt_bench", 1, tok, dirs["data"])[0]
    assert len(p.turns) == 2
    first, second = encode(tok, p, []), encode(tok, p, ["w1 w2 w3"])
    assert second[:len(first)] == first  # the second turn extends the first (ChatML)
    assert tok.decode(second).count("w1 w2 w3") == 1
    with pytest.raises(AnchorspecError, match="answers"):
        encode(tok, p, ["a", "b"])
    plain = Prompt("tpl-plain", "x", ("w1", "w2"), plain=True)
    assert tok.decode(encode(tok, plain, ["w3"])).split() == ["<unk>", "w1", "<unk>", "w3", "<unk>", "w2", "<unk>"]


def test_long_prompts_fit_the_context(dirs):
    tok = tiny_chat_tokenizer()
    for name in LONG_SIZES:
        prompts = load_workload(name, 2, tok, dirs["data"], context=512, max_new_tokens=32)
        for p in prompts:
            n = len(encode(tok, p, []))
            assert 300 <= n <= 512 - 32  # cut to the context, not to the nominal 1k-8k
    real = load_workload("long-1k", 1, tok, dirs["data"], context=None)[0]
    assert 900 <= len(encode(tok, real, [])) <= 1000 + 30
    with pytest.raises(AnchorspecError, match="too short"):
        load_workload("long-1k", 1, tok, dirs["data"], context=300, max_new_tokens=64)
    with pytest.raises(AnchorspecError, match="does not exist"):
        load_workload("gsm8k", 1, tok, dirs["root"])


# --- the runner ------------------------------------------------------------------------------------

def test_every_method_runs_every_prompt(bench):
    out, summary, records = bench
    methods = ["hf", "hf_lookup", "vanilla", "lookup", "d3", "d31"]
    assert summary["methods"] == methods
    # mt_bench: 2 prompts x 2 turns; the others 2 prompts x 1 turn; 2 temperatures
    assert len(records) == (4 + 2 + 2 + 2) * 2 * len(methods)
    assert {r["workload"] for r in records} == {"mt_bench", "gsm8k", "tpl-plain", "long-1k"}
    for r in records:
        assert 1 <= r["new_tokens"] <= 6 and r["seconds"] > 0
        assert (r["stats"] is not None) == (r["kind"] == "drafter" or r["method"] == "lookup")  # what verified drafts


def test_greedy_methods_match_hf_token_for_token(bench):
    """float64: HF generate, HF prompt lookup, the vanilla loop, our prompt lookup and both speculative loops agree."""
    _, summary, records = bench
    greedy = [r for r in records if r["temperature"] == 0]
    assert greedy and all(r["identical_to_baseline"] for r in greedy)
    cells = summary["temperatures"]["0"]["workloads"]
    assert all(c["identical_to_baseline"] == c["generations"] for w in cells.values() for c in w.values())


def test_sampled_runs_are_seeded_per_prompt(bench, dirs, tmp_path):
    """T=1: a rerun gives the same tokens for every method (the seed comes from the prompt)."""
    _, _, records = bench
    again = run_bench(spec(dirs, tmp_path / "again", workloads="gsm8k", temperatures=(1.0,)))
    rerun = [json.loads(line) for line in (tmp_path / "again" / "records.jsonl").read_text().splitlines()[1:]]
    first = {(r["prompt_id"], r["method"]): r["tokens"] for r in records if r["temperature"] == 1}
    assert rerun and all(first[(r["prompt_id"], r["method"])] == r["tokens"] for r in rerun)
    assert again["methods"] == ["hf", "hf_lookup", "vanilla", "lookup", "d3", "d31"]


def test_default_shape_is_the_measured_one_generate_would_choose(dirs, tmp_path):
    """No --chain/--tree: each drafter drafts through generate's Engine with the shape its measured
    costs favour (recorded as such), and greedy output stays the baseline's. Which candidate wins
    depends on this machine's timings (under load the tree did), so the test asks only that it is one
    choose_shape prices."""
    summary = run_bench(spec(dirs, tmp_path / "m", workloads="gsm8k", temperatures=(0.0,), shape=None,
                             baselines=("hf",)))
    shapes = summary["environment"]["drafter_shapes"]
    assert set(shapes) == {"d3", "d31"}
    priced = {describe_shape(s) for s in [TreeShape.chain(d) for d in range(1, MAX_CHAIN + 1)] + list(TREE_CANDIDATES)}
    for text in shapes.values():
        assert text.split(" ")[0] in priced and "(measured" in text, text
    records = [json.loads(line) for line in (tmp_path / "m" / "records.jsonl").read_text().splitlines()[1:]]
    assert records and all(r["identical_to_baseline"] for r in records)


def test_second_turn_follows_the_baseline_answer(bench, dirs):
    _, _, records = bench
    tok = tiny_chat_tokenizer()
    p = load_workload("mt_bench", 1, tok, dirs["data"])[0]
    base0 = next(r for r in records if r["prompt_id"] == p.id and r["turn"] == 0 and r["method"] == "hf"
                 and r["temperature"] == 0)
    answer = tok.decode(base0["tokens"], skip_special_tokens=True)
    turn1 = next(r for r in records if r["prompt_id"] == p.id and r["turn"] == 1)
    assert turn1["prompt_tokens"] == len(encode(tok, p, [answer]))


def test_outputs_written(bench):
    out, summary, _ = bench
    for name in ("records.jsonl", "summary.json", "results.md", "bench-T0.png", "bench-T1.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "| mt_bench | d31 |" in md and "**long (all)**" in md and "tau ratio d31/d3 at T=0" in md
    assert set(summary["tau_ratios"]["0"]["d31/d3"]) >= {"standard", "templates", "long", "gsm8k"}
    peak = summary["temperatures"]["0"]["workloads"]["gsm8k"]["hf"]["peak_mib"]
    assert peak is None or peak > 10  # process RSS high-water mark on Linux


def test_resume_after_a_crash(bench, dirs, tmp_path):
    """Cut the records file inside the third group: the first two groups are kept as they are, the rest redone."""
    out, _, records = bench
    lines = (out / "records.jsonl").read_text().splitlines()
    n_methods = 6
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    kept = lines[: 1 + 2 * n_methods]
    (crashed / "records.jsonl").write_text("\n".join(kept + lines[1 + 2 * n_methods: 3 + 2 * n_methods]) + "\n"
                                           + lines[3 + 2 * n_methods][:40])
    with pytest.raises(AnchorspecError, match="--resume"):
        run_bench(spec(dirs, crashed))
    with pytest.raises(AnchorspecError, match="other settings"):
        run_bench(spec(dirs, crashed, limit=1, resume=True))
    run_bench(spec(dirs, crashed, resume=True))
    resumed = [json.loads(line) for line in (crashed / "records.jsonl").read_text().splitlines()[1:]]
    assert len(resumed) == len(records)
    assert resumed[: 2 * n_methods] == [json.loads(line) for line in kept[1:]]  # untouched, not rerun
    assert [r["seconds"] for r in resumed[2 * n_methods:]] != [r["seconds"] for r in records[2 * n_methods:]]
    assert [(r["key"], r["method"], r["tokens"]) for r in resumed] == [(r["key"], r["method"], r["tokens"])
                                                                        for r in records]


# --- summary math -----------------------------------------------------------------------------------

def _record(workload, pid, method, kind, tps, base_tps, stats=None, same=True):
    return {"key": f"{workload}|{pid}|0|0", "workload": workload, "prompt_id": pid, "turn": 0, "temperature": 0.0,
            "method": method, "kind": kind, "prompt_tokens": 10, "new_tokens": 8, "seconds": 8 / tps,
            "tokens_per_s": tps, "speedup": tps / base_tps, "identical_to_baseline": same, "peak_mib": None,
            "stats": stats.to_dict() if stats else None, "tokens": []}


def _stats(steps):
    s = GenerationStats()
    for depth, accepted in steps:
        s.record_step(depth, depth, accepted)
    return s


def test_summary_pairs_speedups_and_pools_stats():
    recs = []
    for pid, (b, d) in enumerate([(10, 20), (10, 5), (20, 30)]):
        recs.append(_record("gsm8k", pid, "hf", "baseline", b, b))
        recs.append(_record("gsm8k", pid, "a", "drafter", d, b, _stats([(3, 2)] if pid else [(3, 0), (3, 3)])))
        recs.append(_record("gsm8k", pid, "b", "drafter", d, b, _stats([(3, 3)]), same=pid != 1))
    s = summarize(recs)
    a = s["temperatures"]["0"]["workloads"]["gsm8k"]["a"]
    assert a["median_speedup"] == pytest.approx(1.5, abs=1e-3)
    assert a["mean_speedup"] == pytest.approx((2 + 0.5 + 1.5) / 3, abs=1e-3)
    assert a["tau"] == pytest.approx((0 + 3 + 2 + 2 + 4) / 4)  # pooled steps: (sum accepted + steps) / steps
    assert a["acceptance_per_depth"] == pytest.approx([3 / 4, 3 / 3, 1 / 3], abs=1e-3)
    b = s["temperatures"]["0"]["workloads"]["gsm8k"]["b"]
    assert b["tau"] == 4 and b["identical_to_baseline"] == 2
    assert s["tau_ratios"]["0"]["b/a"]["gsm8k"] == pytest.approx(4 / 2.75, abs=1e-3)
    assert s["temperatures"]["0"]["groups"]["standard"]["b"]["tau"] == 4
    assert "| gsm8k | a | 2.75 | 0.75 1.00 0.33 |" in markdown(s)


# --- command line -------------------------------------------------------------------------------------

def test_runs_collect_only_what_was_made_since_the_loop_began(dirs, tmp_path, monkeypatch):
    """The collection before each timed run leaves the heap that was alive at the start frozen (a full one took
    0.2 s); garbage the runs make is still collected, and the heap is unfrozen afterwards."""
    import gc

    from anchorspec.bench import runner

    frozen, freed, collect = [], [], gc.collect

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(1)

    def collecting():
        frozen.append(gc.get_freeze_count())
        Cycle()  # garbage made after the freeze: only a collection frees a cycle
        return collect()

    monkeypatch.setattr(runner.gc, "collect", collecting)
    run_bench(spec(dirs, tmp_path / "out", workloads="mt_bench", limit=1, temperatures=(0.0,)))
    assert len(frozen) > 6 and all(n > 0 for n in frozen[1:])  # the first collects before the freeze
    assert len(freed) >= len(frozen) - 1
    assert gc.get_freeze_count() == 0


def test_cli_bench(dirs, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["bench", "--target", dirs["target"], "--drafter", f"x={dirs['drafters'][1][1]}",
                   "--drafter", f"y={dirs['drafters'][1][1]}@2,3,6",
                   "--baselines", "hf", "--workloads", "qa", "--limit", "1", "--max-new-tokens", "3",
                   "--dtype", "float64", "--chain", "2", "--data-dir", dirs["data"], "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| qa | x |" in text and "wrote" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"] == ["hf", "x", "y"]
    assert summary["environment"]["drafter_shapes"] == {"x": "1,2,3", "y": "2,3,6"}  # --chain 2 unless @SHAPE


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "nodir"], "NAME=DIR"),
    (["--drafter", "x=/does/not/exist"], "does not exist"),
    (["--baselines", "hf,magic"], "unknown baseline"),
    (["--workloads", "nope"], "unknown workload"),
    (["--temperatures", "-1"], "temperatures"),
    (["--drafter", "x={d31}@auto"], "anchorspec tune"),
    (["--drafter", "x={d31}@4,4"], "TOP_K,DEPTH,TOTAL"),
])
def test_cli_bench_errors(dirs, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))  # no tuned profiles
    argv = [a.format(d31=dirs["drafters"][1][1]) for a in argv]
    rc = cli.main(["bench", "--target", dirs["target"], "--data-dir", dirs["data"], "--out", str(tmp_path / "o"),
                   "--dtype", "float64", *argv])
    assert rc == 2 and message in capsys.readouterr().err
